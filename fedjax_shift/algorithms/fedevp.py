"""FedEvp: the single-encoder FedEvolve (FedEvolve paper, Sec. 4.2 and Algorithm 2).

One encoder f_φ and classifier w. Client k, for τ local iterations, with evolving
prototypes C_0 = 0, for m = 1 … M:

  A ~ D_m^k
  ℓ_e = CE(w(f_φ(A)), y)                                            (Eq. 7)
  C_m = (m−1)/m · C_{m−1} + 1/m · mean_{x ∈ A_y} f_φ(x)            (Eq. 5, per class)
  if m ≥ 2:
    ℓ_f = −mean_{(x,y) ∈ A} log softmax_y(−d(f_φ(x), C_m))         (Eq. 6, Alg. 2 l. 19)
    (φ, w) ← (φ, w) − η ∇(ℓ_e + ℓ_f)                               (Alg. 2 l. 21)

τ counts iterations or epochs as FedEvolve's ``tau_unit`` (algorithms/domains.py).
The running prototypes are state (no gradient flows through them); a class not yet
seen is absent from C and skipped. ``fedevp.align`` picks between the paper's two
readings: 'algorithm2' (default, Algorithm 2 as written: C_m is updated with A first
(line 15) and A is aligned to C_m (line 20), and the step is taken only for m ≥ 2, so
the first domain moves nothing) and 'eq6' (the text of Eq. 6: domain m aligned to
C_{m−1}, a cross-entropy step on the first domain too).
Server: uniform mean of (φ, w). Personalisation (Sec. 4.2): the classifier and the
encoder's last layer fine-tuned for ``fedevp.finetune_epochs`` (1) epoch on the client's
data (``fedevp.personalize``: Table 8's 'classifier', 'all' or 'none' instead); "client"
accuracy uses it, "server" the global model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.algorithms.domains import (TAU_UNITS, domain_batch, iteration_budget,
                                             layout_from_info, local_iterations)
from fedjax_shift.algorithms.prototypes import class_prototypes, prototype_loss
from fedjax_shift.core.algorithm import ClientOutput, FederatedAlgorithm
from fedjax_shift.core.local import local_train, masked_mean, run_steps, select
from fedjax_shift.parts import trees
from fedjax_shift.registry import NONNEGATIVE_INT, one_of


def last_layer_selector(module, input_shape: tuple):
  """Path predicate: the head and the encoder's last layer, in the order the model
  defines its layers (``models.layer_order``; evolve_cnn's Dense_0, an MLP's last
  Dense), never dict order."""
  is_last = models.layer_selector(module, input_shape, 'last', 'fedevp')
  return lambda path: path[0] == 'head' or is_last(path)


# What personalisation fine-tunes (Table 8): the default of Sec. 4.2, and the ablation's
# three others ('none': the client keeps the global model).
PERSONALIZE = ('last_layer', 'classifier', 'all', 'none')


def tuned_selector(personalize: str, module, input_shape: tuple):
  """Path predicate of the parameters ``personalize`` fine-tunes."""
  if personalize == 'last_layer':
    return last_layer_selector(module, input_shape)
  if personalize == 'classifier':
    return lambda path: path[0] == 'head'
  return lambda path: personalize == 'all'


ALIGNS = ('algorithm2', 'eq6')


@base.ALGORITHMS.register('fedevp', defaults={
    'finetune_epochs': 1,       # App. D: 1 epoch
    'align': 'algorithm2',      # 'algorithm2' (as written) | 'eq6' (the text's C_{m−1})
    # Sec. 4.2: the classifier and the encoder's last layer; Table 8: 'classifier',
    # 'all' or 'none' (no personalisation)
    'personalize': 'last_layer',
    'tau_unit': 'iterations',   # τ = client.local_epochs counts: 'iterations' | 'epochs'
}, ranges={
    'finetune_epochs': NONNEGATIVE_INT,   # 0: the global model, not fine-tuned
    'align': one_of(*ALIGNS), 'personalize': one_of(*PERSONALIZE),
    'tau_unit': one_of(*TAU_UNITS),
}, layout='domains')  # domain-major client data
def fedevp(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  layout = layout_from_info(context.info, context.schedule.max_examples, 'fedevp')
  num_classes = module.num_classes
  tau, batch_size = context.schedule.num_epochs, context.schedule.batch_size
  iterations = local_iterations(layout, tau, hparams.tau_unit, batch_size)
  client_opt, server_opt = context.client_optimizer, context.server_optimizer
  finetune_schedule = base.epochs_schedule(context.schedule, hparams.finetune_epochs)

  init = base.init_server(module, server_opt)

  algorithm2 = hparams.align == 'algorithm2'
  if algorithm2 and layout.num_domains < 2:
    raise ValueError(f"config.fedevp.align='algorithm2' steps only from the second source "
                     f'domain on, and this benchmark has {layout.num_domains}: add domains '
                     f"or use align='eq6'")

  def domain_loss(params, model_state, x, y, weight, prototypes, domains_seen, align):
    """ℓ_e + ℓ_f on one domain's batch (train mode: BatchNorm with the batch's
    statistics), and (C_m, the domains each class was seen in: Eq. 5 per class,
    counting the domains in which the class appeared, the updated running statistics)."""
    features, variables = models.train_features(module, {'params': params, **model_state}, x)
    logits = models.head({'params': params}, features)
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    batch_protos, batch_counts = class_prototypes(jax.lax.stop_gradient(features), y, weight,
                                                  num_classes)
    new_seen = domains_seen + (batch_counts > 0)
    mixed = prototypes + (batch_protos - prototypes) / jnp.maximum(new_seen, 1)[:, None]
    new_protos = jnp.where((batch_counts > 0)[:, None], mixed, prototypes)
    target, seen = (new_protos, new_seen) if algorithm2 else (prototypes, domains_seen)
    align_loss = prototype_loss(features, y, weight, target, seen > 0)
    return ce + jnp.where(align, align_loss, 0.0), (new_protos, new_seen,
                                                    base.split_variables(variables)[1])

  grad_fn = jax.value_and_grad(domain_loss, has_aux=True)

  def client_update(server_state, client_state, data, rng):
    budget = iteration_budget(data, layout, tau, hparams.tau_unit, batch_size)
    params, model_state = base.split_variables(server_state.variables)

    def iteration(carry, it):   # one pass over the domains; run_steps masks it past budget
      def domain(carry, m):
        params, model_state, opt_state, protos, counts_seen, loss_sum = carry
        x, y, weight = domain_batch(data, layout, m, jax.random.fold_in(
            jax.random.fold_in(rng, it), m), batch_size)
        (loss, (new_protos, domains_seen, new_state)), grads = grad_fn(
            params, model_state, x, y, weight, protos, counts_seen, m > 0)
        updates, new_opt = client_opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        steps = (m > 0) if algorithm2 else True   # Alg. 2: a step only for m ≥ 2
        # Every domain's forward updates the running statistics (a train-mode forward
        # in PyTorch does, step or not).
        return (select(steps, new_params, params), new_state,
                select(steps, new_opt, opt_state), new_protos, domains_seen,
                loss_sum + jnp.where(steps, loss, 0.0).astype(loss_sum.dtype)), None

      params, model_state, opt_state, loss_sum = carry
      empty = (jnp.zeros((num_classes, features_dim)), jnp.zeros((num_classes,)))
      (params, model_state, opt_state, _, _, loss_sum), _ = jax.lax.scan(
          domain, (params, model_state, opt_state) + empty + (loss_sum,),
          jnp.arange(layout.num_domains), unroll=context.schedule.unroll)
      return params, model_state, opt_state, loss_sum

    features_dim = models.features(module, server_state.variables, data.x[:1]).shape[-1]
    params, model_state, _, loss_sum = run_steps(
        iteration, (params, model_state, client_opt.init(params), jnp.float32(0.0)), budget,
        iterations, context.schedule.unroll)
    steps = budget * (layout.num_domains - 1 if algorithm2 else layout.num_domains)
    metrics = {'loss': loss_sum / jnp.maximum(steps, 1), 'num_steps': steps.astype(jnp.float32)}
    update = trees.tree_sub({'params': params, **model_state}, server_state.variables)
    return ClientOutput(update, metrics), client_state

  def personalize(server_state, client_state, data, rng):
    del client_state
    params, model_state = base.split_variables(server_state.variables)
    if hparams.personalize == 'none':
      return server_state.variables
    is_tuned = tuned_selector(hparams.personalize, module, tuple(data.x.shape[1:]))
    flat = traverse_util.flatten_dict(params)
    tuned = {p: v for p, v in flat.items() if is_tuned(p)}
    frozen = {p: v for p, v in flat.items() if not is_tuned(p)}
    join = lambda tuned: traverse_util.unflatten_dict({**frozen, **tuned})
    ce = base.cross_entropy_loss(module)

    def loss_fn(tuned, model_state, x, y, weight, step_rng):
      return ce(join(tuned), model_state, x, y, weight, step_rng)

    tuned, model_state, _, _ = local_train(loss_fn, client_opt, tuned, model_state, data, rng,
                                           finetune_schedule)
    return {'params': join(tuned), **model_state}

  return FederatedAlgorithm(
      init=init, init_client_state=lambda state: (), client_update=client_update,
      server_update=base.average_server_update(server_opt), personalize=personalize,
      global_model=lambda state: state.variables)
