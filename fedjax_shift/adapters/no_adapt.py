"""No adaptation: the source model predicts with its running statistics."""
from fedjax_shift import models
from fedjax_shift.core.test_time import ADAPTERS, Adapter, SourceContext


def no_adapt(module) -> Adapter:
  return Adapter(init=lambda variables, rng: variables,
                 step=lambda variables, batch: (variables,
                                                models.apply(module, variables, batch.x)[0]))


@ADAPTERS.register('no_adapt', defaults={})
def build_no_adapt(module, hparams, context: SourceContext) -> Adapter:
  """The registry's builder: this method from its ``config.adapters.no_adapt``."""
  return no_adapt(module)
