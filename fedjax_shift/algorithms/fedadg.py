"""FedADG: federated adversarial domain generalisation. Zhang et al., "Federated Learning
with Domain Generalization", 2021 (arXiv:2111.10487); a Table 1 baseline of FedTTA
(Ye et al., UPFL 2023, App. B: noise dimension 10, η_f 0.3 on MNIST).

Each client's features h = F(x) are aligned to a reference distribution r = G(z, y)
that a conditional generator adapts to all clients, judged by a conditional
discriminator D(y, ·) ∈ (0, 1), least-squares adversarial losses, ỹ = 0.6 · onehot(y),
z ~ U[0, 1)^10:

  L_err  = CE(C(h), y)
  L_advf = E (1 − D(ỹ, h))²                              F: features look like references
  L_advd = E (1 − D(ỹ, r))² + E D(ỹ, h)²                 D: references 1, features 0
  L_advg = E D(ỹ, r)²                                    G: references move to the features
  F, C minimise λ_0 L_advf + (1 − λ_0) L_err; D minimises L_advd; G minimises L_advg.

Every local step takes one gradient step of each player on the batch, simultaneously
(each loss reaches only its own player's parameters: ``stop_gradient`` on the others),
where the authors' order is sequential F → D → G. The server averages F, C, G and D
(FedAvg). The global model is C ∘ F. ``lr_f`` (η_f) is ``config.client.learning_rate``;
D and G use ``adversarial_learning_rate``.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_shift import models
from fedjax_shift.algorithms import base
from fedjax_shift.core.algorithm import FederatedAlgorithm
from fedjax_shift.core.local import masked_mean
from fedjax_shift.registry import FRACTION, POSITIVE, POSITIVE_INT

LABEL_SCALE = 0.6   # ỹ = 0.6 · onehot(y), D's and G's label input


class Generator(nn.Module):
  """r = G(z, ỹ): an MLP to the feature dimension, ReLU output (features are ≥ 0)."""
  feature_dim: int
  hidden: int

  @nn.compact
  def __call__(self, noise, labels):
    h = nn.relu(nn.Dense(self.hidden)(jnp.concatenate([noise, labels], -1)))
    return nn.relu(nn.Dense(self.feature_dim)(h))


class Discriminator(nn.Module):
  """D(ỹ, h) ∈ (0, 1)."""
  hidden: int

  @nn.compact
  def __call__(self, labels, features):
    h = nn.relu(nn.Dense(self.hidden)(jnp.concatenate([labels, features], -1)))
    return nn.sigmoid(nn.Dense(1)(h))[..., 0]


@base.ALGORITHMS.register('fedadg', defaults={
    'lambda_0': 0.5,                  # weight of L_advf against L_err (not in FedTTA's App. B)
    'noise_dim': 10,                  # FedTTA App. B: "dimension of the random noise 10"
    'hidden': 128,                    # G's and D's hidden width
    'adversarial_learning_rate': 0.1, # SGD for D and G (not given)
}, ranges={'lambda_0': FRACTION, 'noise_dim': POSITIVE_INT, 'hidden': POSITIVE_INT,
           'adversarial_learning_rate': POSITIVE}, batch_norm=False)
def fedadg(hparams: ml_collections.ConfigDict, context: base.BuildContext) -> FederatedAlgorithm:
  module = context.module
  num_classes = module.num_classes
  server_opt = context.server_optimizer
  client_opt = optax.multi_transform(
      {'model': context.client_optimizer,
       'adversarial': optax.sgd(hparams.adversarial_learning_rate)},
      {'model': 'model', 'fedadg': 'adversarial'})
  discriminator = Discriminator(hparams.hidden)

  def init(rng, example_x):
    model_key, generator_key, discriminator_key = jax.random.split(rng, 3)
    variables = models.init(module, model_key, example_x)
    if set(variables) != {'params'}:
      raise ValueError('FedADG here needs a model without BatchNorm statistics (mlp, evolve_cnn)')
    features = models.features(module, variables, example_x)
    labels = jnp.zeros((1, num_classes))
    generator = Generator(features.shape[-1], hparams.hidden)
    params = {'model': variables['params'], 'fedadg': {
        'generator': generator.init(generator_key, jnp.zeros((1, hparams.noise_dim)),
                                    labels)['params'],
        'discriminator': discriminator.init(discriminator_key, labels, features)['params']}}
    return base.ServerState({'params': params}, server_opt.init(params), jnp.int32(0))

  def loss_fn(params, model_state, x, y, weight, rng):
    adversarial = params['fedadg']
    sg = jax.lax.stop_gradient
    features = models.features(module, {'params': params['model']}, x)
    logits = models.head({'params': params['model']}, features)
    labels = LABEL_SCALE * jax.nn.one_hot(y, num_classes)
    noise = jax.random.uniform(rng, (x.shape[0], hparams.noise_dim))
    generator = Generator(features.shape[-1], hparams.hidden)
    reference = generator.apply({'params': adversarial['generator']}, noise, labels)
    judge = lambda d_params, h: discriminator.apply({'params': d_params}, labels, h)
    d_params = adversarial['discriminator']
    loss_err = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), weight)
    loss_advf = masked_mean((1 - judge(sg(d_params), features)) ** 2, weight)
    loss_advd = masked_mean((1 - judge(d_params, sg(reference))) ** 2 +
                            judge(d_params, sg(features)) ** 2, weight)
    loss_advg = masked_mean(judge(sg(d_params), reference) ** 2, weight)
    lam = hparams.lambda_0
    return ((lam * loss_advf + (1 - lam) * loss_err) + loss_advd + loss_advg), model_state

  return base.params_averaging(
      init, loss_fn, client_opt, context,
      global_model=lambda state: {'params': state.variables['params']['model']})
