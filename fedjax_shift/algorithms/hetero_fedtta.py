"""HeteroFedTTA: FedTTA across clients of different architectures, through FedMD-style
distillation on a public unlabelled set. Ye et al., UPFL 2023, Sec. 3.4
(Eq. 14, Algorithm 2) and Sec. 4.6.

Each client keeps its own base model ψ_i and adaptation model φ_i, of its group's size
(small / medium / big); no parameters are exchanged. The server holds the ensemble
knowledge on the public set D_p, F_base(D_p) and F_per(D_p). Round r, client i:

  Digest    (r > 0) ``digest_steps`` steps on public batches X_p of
            L_KD = KL(σ(F_per(X_p)) ‖ σ(f(X_p; ψ̃_i))) + λ KL(σ(F_base(X_p)) ‖ σ(f(X_p; ψ_i)))
            with ψ̃_i = ψ_i − η_inner ∇ψ ‖g(f(X_p; ψ_i); φ_i)‖₂      (Eq. 14)
  Revisit   τ FedTTA meta-training steps on its labelled data       (Eqs. 5–9)
  Communicate  f(D_p; ψ_i) and f(D_p; ψ̃_i), each public batch's ψ̃_i adapted on
            that batch                                                (Alg. 2)
Server:  F_base = 1/N Σ_i f(D_p; ψ_i),  F_per = 1/N Σ_i f(D_p; ψ̃_i)   (Alg. 2)
         (``ensemble='probabilities'``: log 1/N Σ_i σ(f(·)) instead, not in the paper)

A new client picks an architecture, initialises it, digests the final knowledge with
Eq. 14 for ``new_client_digest_steps`` steps and adapts on its unlabelled data with
FedTTA's inner step (``adapters/fedtta.py``). The KL is taken teacher ‖ student (the
usual distillation direction; Eq. 14 writes ℓ_KL(student, teacher) without saying
which way). Each public batch is a fixed block of ``public_batch_size`` examples, so
teacher and student adapt ψ̃ on the same batch. The round is ``core/groups.py``: each
group its own vmapped stack, one compiled call.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import fedtta
from fedjax_shift.core.algorithm import ClientOutput
from fedjax_shift.core.groups import ClientGroup, GroupedAlgorithm
from fedjax_shift.core.local import LocalSchedule, local_train
from fedjax_shift.parts import fedtta_step
from fedjax_shift.registry import (NONNEGATIVE, NONNEGATIVE_INT, POSITIVE_INT, one_of,
                                   sequence_of)

# The three complexity levels (App. G "by controlling the hidden channels", Table 3):
# base_model 'lenet5' is Table 3's, conv 5x5 of these channels → MLP(512) → MLP(C) (the
# authors' CIFAR10_LeNet5_small / medium / big); 'mlp' is the CPU-cheap stand-in, MLPs
# of these hidden widths. g's widths are Table 3's in both (fedtta_step.ADAPTATION_SIZES).
BASE_CHANNELS = {'small': (16, 32), 'medium': (32, 64), 'big': (64, 128)}
BASE_HIDDEN = {'small': (100, 100), 'medium': (200, 200), 'big': (400, 400)}
SIZES = tuple(BASE_HIDDEN)
BASE_MODELS = ('mlp', 'lenet5')

DEFAULTS = {
    'sizes': SIZES,                 # the architectures, assigned to clients in turn (App. G)
    'base_model': 'mlp',            # 'mlp' | 'lenet5' (Table 3's CNNs; see BASE_CHANNELS)
    'kd_lambda': 0.8,               # λ of Eq. 14 (Sec. 4.6: best near 0.8)
    'digest_steps': 10,             # Eq. 14 steps per round on public batches
    'new_client_digest_steps': 100, # Eq. 14 steps of a new client before it adapts
    'public_batch_size': 50,        # a public batch (teacher and student adapt on it);
                                    # D_p itself is the benchmark's (data.public_source)
    'inner_learning_rate': 0.5,     # η_inner (Sec. 4.6: 0.5)
    'adapt_learning_rate': 0.005,   # η_adapt (Sec. 4.6: 0.005); η_outer = client.learning_rate
    # ε, the outer clip (not in the paper), its groups and the authors' meta_opt (its
    # momentum, digest too, and weight decay): FedTTA's defaults (algorithms/fedtta.py)
    **{field: fedtta.FEDTTA_DEFAULTS[field] for field in (
        'norm_epsilon', 'clip_norm', 'clip_groups', 'adapt_momentum', 'weight_decay')},
    # How the server combines the clients' public logits: 'logits' (Alg. 2: their mean)
    # or 'probabilities' (log of the mean softmax; not in the paper: fedjax_shift/papers/fedtta/README.md).
    'ensemble': 'logits',
}
ENSEMBLES = ('logits', 'probabilities')
# config.hetero_fedtta's ranges (the hetero pipeline declares them under that section).
RANGES = {
    **fedtta.META_OPTIMIZER_RANGES, **fedtta.INNER_STEP_RANGES,
    'sizes': sequence_of(one_of(*SIZES), 1),
    'base_model': one_of(*BASE_MODELS),
    'kd_lambda': NONNEGATIVE,                 # 0: distil F_per only
    'digest_steps': NONNEGATIVE_INT,          # 0: no digest (clients train alone)
    'new_client_digest_steps': NONNEGATIVE_INT,
    'public_batch_size': POSITIVE_INT,        # and divides data.public_examples (the pipeline)
    'ensemble': one_of(*ENSEMBLES),
}


class Knowledge(NamedTuple):
  """The server state: ensemble logits on D_p and the rounds applied."""
  base: jax.Array          # [P, C] F_base(D_p)
  personalized: jax.Array  # [P, C] F_per(D_p)
  round: jax.Array         # [] int32


class Architecture(NamedTuple):
  module: object              # f(·; ψ)
  adaptation_module: object   # g(·; φ)


def architecture(size: str, num_classes: int, base_model: str = 'mlp') -> Architecture:
  """The base and adaptation models of complexity ``size`` (BASE_CHANNELS)."""
  if base_model == 'lenet5':
    module = models.lenet5(num_classes, BASE_CHANNELS[size])
  else:
    module = models.mlp(num_classes, BASE_HIDDEN[size])
  return Architecture(module, fedtta.adaptation_model(size))


def init_params(arch: Architecture, rng: jax.Array, example_x: jax.Array) -> Dict:
  """{'base': ψ, 'adaptation': φ} of a fresh client; example_x [B, ...]."""
  base_key, adaptation_key = jax.random.split(rng)
  base = models.init(arch.module, base_key, example_x)['params']
  logits = arch.module.apply({'params': base}, example_x)
  return {'base': base,
          'adaptation': arch.adaptation_module.init(adaptation_key, logits)['params']}


def public_batches(public_x: jax.Array, batch_size: int) -> jax.Array:
  """[P, ...] -> [P / b, b, ...] fixed public batches."""
  return public_x.reshape((-1, batch_size) + public_x.shape[1:])


def batch_logits(arch: Architecture, params, x: jax.Array, hparams):
  """(f(x; ψ), f(x; ψ̃)) on one public batch x [b, ...], ψ̃ the inner step of ψ under φ
  on x itself (Eq. 5): the logits a client sends and the ones Eq. 14 distils."""
  adapted = fedtta_step.inner_step(
      arch.module, arch.adaptation_module, params['base'], params['adaptation'], x,
      jnp.ones(x.shape[0]), fedtta_step.InnerStep(hparams.inner_learning_rate,
                                                  hparams.norm_epsilon))
  return (arch.module.apply({'params': params['base']}, x),
          arch.module.apply({'params': adapted}, x))


def public_logits(arch: Architecture, params, batches: jax.Array, hparams
                  ) -> Dict[str, jax.Array]:
  """{'base': f(D_p; ψ), 'personalized': f(D_p; ψ̃)} each [P, C]; ψ̃ is adapted on each
  public batch of ``batches`` [P / b, b, ...] (Alg. 2, Communicate)."""
  base, personalized = jax.lax.map(lambda x: batch_logits(arch, params, x, hparams), batches)
  flat = lambda logits: logits.reshape((-1,) + logits.shape[2:])
  return {'base': flat(base), 'personalized': flat(personalized)}


def kl_to_teacher(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
  """[B] KL(σ(teacher) ‖ σ(student)) per example."""
  teacher = jax.nn.log_softmax(teacher_logits)
  return jnp.sum(jnp.exp(teacher) * (teacher - jax.nn.log_softmax(student_logits)), -1)


def kd_loss(arch: Architecture, params, x: jax.Array, teacher_base: jax.Array,
            teacher_personalized: jax.Array, hparams) -> jax.Array:
  """Eq. 14 on one public batch x [b, ...] with the teachers' logits [b, C], averaged
  over the batch: KL(F_per ‖ f(·; ψ̃)) + λ KL(F_base ‖ f(·; ψ))."""
  base, personalized = batch_logits(arch, params, x, hparams)
  return (jnp.mean(kl_to_teacher(teacher_personalized, personalized)) +
          hparams.kd_lambda * jnp.mean(kl_to_teacher(teacher_base, base)))


def digest(arch: Architecture, optimizer: optax.GradientTransformation, params,
           knowledge: Knowledge, batches: jax.Array, num_steps: int, rng: jax.Array,
           hparams, scale: jax.Array = 1.0):
  """``num_steps`` optimizer steps of ``scale`` · Eq. 14, step s on public batch
  perm[s mod (P / b)] (perm drawn from ``rng``); ``scale`` 0 takes no step at all (the
  optimizer's weight decay would still move the parameters). Returns (params, mean
  loss)."""
  num_batches = batches.shape[0]
  teacher_base = public_batches(knowledge.base, batches.shape[1])
  teacher_personalized = public_batches(knowledge.personalized, batches.shape[1])
  order = jax.random.permutation(rng, num_batches)
  grad_fn = jax.value_and_grad(lambda p, j: scale * kd_loss(
      arch, p, batches[j], teacher_base[j], teacher_personalized[j], hparams))

  def step(carry, s):
    params, opt_state, total = carry
    loss, grads = grad_fn(params, order[s % num_batches])
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, total + loss), None

  (stepped, _, total), _ = jax.lax.scan(step, (params, optimizer.init(params), 0.0),
                                        jnp.arange(num_steps))
  params = jax.tree.map(lambda new, old: jnp.where(scale > 0, new, old), stepped, params)
  return params, total / max(num_steps, 1)


def build(hparams: ml_collections.ConfigDict, num_classes: int, public_x: jax.Array,
          base_optimizer: optax.GradientTransformation, schedule: LocalSchedule,
          example_x: jax.Array) -> GroupedAlgorithm:
  """The grouped algorithm, one ClientGroup per ``hparams.sizes``. public_x: [P, ...]
  unlabelled; example_x [1, ...] for initialisation; ``base_optimizer``: η_outer's."""
  optimizer = fedtta.meta_optimizer(base_optimizer, hparams)
  batches = public_batches(jnp.asarray(public_x), hparams.public_batch_size)
  num_public = batches.shape[0] * batches.shape[1]

  def group(size: str) -> ClientGroup:
    arch = architecture(size, num_classes, hparams.base_model)

    def client_update(knowledge: Knowledge, params, data, rng):
      # Digest (no knowledge before the first aggregation: scaled to 0 in round 0).
      params, kd = digest(arch, optimizer, params, knowledge, batches, hparams.digest_steps,
                          jax.random.fold_in(rng, 0), hparams,
                          (knowledge.round > 0).astype(jnp.float32))

      def loss_fn(params, model_state, x, y, weight, step_rng):   # Revisit (FedTTA)
        del step_rng
        return fedtta.meta_loss(arch.module, arch.adaptation_module, params, x, y, weight,
                                hparams), model_state

      params, _, _, metrics = local_train(loss_fn, optimizer, params, {}, data,
                                          jax.random.fold_in(rng, 1), schedule)
      logits = public_logits(arch, params, batches, hparams)   # Communicate
      return ClientOutput(logits, {**metrics, 'kd_loss': kd}), params

    return ClientGroup(size, lambda rng: init_params(arch, rng, example_x), client_update)

  def init(rng):
    del rng
    zeros = jnp.zeros((num_public, num_classes))
    return Knowledge(zeros, zeros, jnp.int32(0))

  def server_update(knowledge: Knowledge, outputs: ClientOutput, weights):
    if hparams.ensemble == 'logits':   # F = Σ_i w_i f(D_p; ψ_i) (Alg. 2, w_i = 1/N)
      mean = lambda logits: jnp.tensordot(weights, logits, axes=1)
    else:                              # log Σ_i w_i σ(f(D_p; ψ_i))
      mean = lambda logits: jnp.log(jnp.tensordot(weights, jax.nn.softmax(logits), axes=1)
                                    + 1e-12)
    return Knowledge(mean(outputs.update['base']), mean(outputs.update['personalized']),
                     knowledge.round + 1)

  return GroupedAlgorithm(init, tuple(group(size) for size in hparams.sizes), server_update)


def new_client_params(size: str, num_classes: int, hparams, knowledge: Knowledge,
                      public_x: jax.Array, base_optimizer: optax.GradientTransformation,
                      example_x: jax.Array, rng: jax.Array):
  """(a new client's {'base', 'adaptation'} of architecture ``size``, initialised from
  ``fold_in(rng, 0)`` and digested for ``new_client_digest_steps`` (Alg. 2, Test);
  {'base', 'adaptation'}: each part's distance from its initialisation, relative,
  ‖θ − θ_0‖ / ‖θ_0‖)."""
  arch = architecture(size, num_classes, hparams.base_model)
  initial = init_params(arch, jax.random.fold_in(rng, 0), example_x)
  params, _ = digest(arch, fedtta.meta_optimizer(base_optimizer, hparams), initial, knowledge,
                     public_batches(jnp.asarray(public_x), hparams.public_batch_size),
                     hparams.new_client_digest_steps, jax.random.fold_in(rng, 1), hparams)
  norm = lambda tree: jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(tree)))
  drift = {part: norm(jax.tree.map(jnp.subtract, params[part], initial[part])) /
           norm(initial[part]) for part in ('base', 'adaptation')}
  return params, drift


def variables_of(params) -> Dict:
  """Model variables in the layout ``adapters/fedtta.py`` reads."""
  return {'params': params['base'], fedtta_step.ADAPTATION: params['adaptation']}


def assign_sizes(num_clients: int, sizes: Sequence[str], rng) -> list:
  """Each client's architecture: the sizes in turn over a random order of the clients,
  so each is equally likely and the groups differ in size by at most one (App. G)."""
  order = rng.permutation(num_clients)
  assigned = [None] * num_clients
  for position, client in enumerate(order):
    assigned[client] = sizes[position % len(sizes)]
  return assigned

