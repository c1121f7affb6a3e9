"""No adaptation: the source model predicts with its running statistics."""
from fedjax_shift import models
from fedjax_shift.core.test_time import Adapter, register_constructor


@register_constructor('no_adapt')
def no_adapt(module) -> Adapter:
  return Adapter(init=lambda variables, rng: variables,
                 step=lambda variables, batch: (variables,
                                                models.apply(module, variables, batch.x)[0]))
