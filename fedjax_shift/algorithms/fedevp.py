"""FedEvp: the single-encoder FedEvolve (FedEvolve paper, Sec. 4.2 and Algorithm 2).

One encoder f_φ and classifier w. Client k, for τ local iterations, with evolving
prototypes C_0 = 0, for m = 1 … M:

  A ~ D_m^k
  ℓ_e = CE(w(f_φ(A)), y)                                            (Eq. 7)
  ℓ_f = −mean_{(x,y) ∈ A} log softmax_y(−d(f_φ(x), C_{m−1}))   (m ≥ 2; Eq. 6: data of the
                                                                next domain aligned to the
                                                                prototypes so far)
  (φ, w) ← (φ, w) − η ∇(ℓ_e + ℓ_f)
  C_m = (m−1)/m · C_{m−1} + 1/m · mean_{x ∈ A_y} f_φ(x)            (Eq. 5, per class)

The running prototypes are state (no gradient flows into past domains); a class not
yet seen is absent from C and skipped. Algorithm 2 of the paper updates C_m with A
before aligning A to it; we follow Eq. 6, which aligns domain m to C_{m−1}.
Server: uniform mean of (φ, w). Personalisation (Sec. 4.2): the classifier and the
encoder's last layer fine-tuned for ``fedevp.finetune_epochs`` (1) epoch on the client's
data; "client" accuracy uses it, "server" the global model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.domains import domain_batch, layout_from_info
from fedjax_shift.algorithms.prototypes import class_prototypes, prototype_loss
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean, select


def last_layer_selector(module, input_shape: tuple):
  """Path predicate: the head and the encoder's last layer, in the order the model
  defines its layers (``models.layer_order``; evolve_cnn's Dense_0, an MLP's last
  Dense), never dict order."""
  is_last = models.layer_selector(module, input_shape, 'last', 'fedevp')
  return lambda path: path[0] == 'head' or is_last(path)


@base.ALGORITHMS.register('fedevp', defaults={'finetune_epochs': 1},  # App. D: 1 epoch
                          layout='domains', batch_norm=False)  # domain-major client data
def fedevp(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  layout = layout_from_info(context.info, context.schedule.max_examples, 'fedevp')
  num_classes = module.num_classes
  iterations = context.schedule.num_epochs
  batch_size = context.schedule.batch_size
  client_opt, server_opt = context.client_optimizer, context.server_optimizer
  finetune_schedule = base.epochs_schedule(context.schedule, hparams.finetune_epochs)

  def init(rng, example_x):
    state = base.init_server(module, server_opt)(rng, example_x)
    if set(state.variables) != {'params'}:
      raise ValueError('FedEvp needs a model without BatchNorm statistics (evolve_cnn, mlp)')
    return state

  def domain_loss(params, x, y, weight, prototypes, present, align):
    features = models.features(module, {'params': params}, x)
    logits = models.head({'params': params}, features)
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    align_loss = prototype_loss(features, y, weight, prototypes, present)
    return ce + jnp.where(align, align_loss, 0.0), features

  grad_fn = jax.value_and_grad(domain_loss, has_aux=True)

  def client_update(server_state, client_state, data, rng):
    budget = jnp.minimum(iterations, data.step_budget)
    budget = jnp.where(data.num_examples > 0, budget, 0)
    params = server_state.variables['params']

    def iteration(carry, it):
      def domain(carry, m):
        params, opt_state, protos, counts_seen, loss_sum = carry
        x, y, weight = domain_batch(data, layout, m, jax.random.fold_in(
            jax.random.fold_in(rng, it), m), batch_size)
        (loss, features), grads = grad_fn(params, x, y, weight, protos, counts_seen > 0, m > 0)
        updates, new_opt = client_opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        batch_protos, batch_counts = class_prototypes(jax.lax.stop_gradient(features), y,
                                                      weight, num_classes)
        seen = (batch_counts > 0)[:, None]
        # Eq. 5 per class, counting the domains in which the class appeared.
        domains_seen = counts_seen + (batch_counts > 0)
        mixed = protos + (batch_protos - protos) / jnp.maximum(domains_seen, 1)[:, None]
        new_protos = jnp.where(seen, mixed, protos)
        active = it < budget
        return (select(active, new_params, params), select(active, new_opt, opt_state),
                new_protos, domains_seen,
                loss_sum + jnp.where(active, loss, 0.0).astype(loss_sum.dtype)), None

      params, opt_state, loss_sum = carry
      empty = (jnp.zeros((num_classes, features_dim)), jnp.zeros((num_classes,)))
      (params, opt_state, _, _, loss_sum), _ = jax.lax.scan(
          domain, (params, opt_state) + empty + (loss_sum,), jnp.arange(layout.num_domains),
          unroll=context.schedule.unroll)
      return (params, opt_state, loss_sum), None

    features_dim = models.features(module, {'params': params}, data.x[:1]).shape[-1]
    (params, _, loss_sum), _ = jax.lax.scan(
        iteration, (params, client_opt.init(params), jnp.float32(0.0)), jnp.arange(iterations),
        unroll=context.schedule.unroll)
    steps = budget * layout.num_domains
    metrics = {'loss': loss_sum / jnp.maximum(steps, 1), 'num_steps': steps.astype(jnp.float32)}
    update = base.tree_sub({'params': params}, server_state.variables)
    return ClientOutput(update, metrics), client_state

  def personalize(server_state, client_state, data, rng):
    del client_state
    params = server_state.variables['params']
    is_tuned = last_layer_selector(module, tuple(data.x.shape[1:]))
    flat = traverse_util.flatten_dict(params)
    tuned = {p: v for p, v in flat.items() if is_tuned(p)}
    frozen = {p: v for p, v in flat.items() if not is_tuned(p)}
    join = lambda tuned: traverse_util.unflatten_dict({**frozen, **tuned})
    ce = base.cross_entropy_loss(module)

    def loss_fn(tuned, model_state, x, y, weight, step_rng):
      return ce(join(tuned), model_state, x, y, weight, step_rng)

    tuned, _, _, _ = local_train(loss_fn, client_opt, tuned, {}, data, rng, finetune_schedule)
    return {'params': join(tuned)}

  return FederatedAlgorithm(
      init=init, init_client_state=lambda state: (), client_update=client_update,
      server_update=base.average_server_update(server_opt), personalize=personalize,
      global_model=lambda state: state.variables)
