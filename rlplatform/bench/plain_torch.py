"""The DQN and SAC updates in plain torch, CleanRL-style, for `bench learner`'s limit.

Same networks (an experiment's RLlib module, whose encoders and heads are torch modules), same
losses (Huber TD errors against n-step targets, SAC's entropy-regularised actor and temperature),
same Adam settings and gradient clipping; no learner, connector, buffer of episodes or metrics.
Only the arithmetic of the update and the draw of its batch remain: the rate no learner on this
machine can beat by more than noise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from ray.rllib.core.columns import Columns
from ray.rllib.core.models.base import ENCODER_OUT
from ray.rllib.utils.numpy import MAX_LOG_NN_OUTPUT, MIN_LOG_NN_OUTPUT

_huber = torch.nn.HuberLoss(reduction="none", delta=1.0)


def _polyak(main: torch.nn.Module, target: torch.nn.Module, tau: float) -> None:
    with torch.no_grad():
        for t, m in zip(target.parameters(), main.parameters()):
            t.mul_(1.0 - tau).add_(m, alpha=tau)


class PlainSAC:
    def __init__(self, module: Any, config: Any) -> None:
        self.m, self.gamma, self.tau = module, config.gamma, config.tau
        self.log_alpha = torch.tensor([math.log(config.initial_alpha)], requires_grad=True)
        action_dim = math.prod(module.action_space.shape)
        self.target_entropy = -float(action_dim) if config.target_entropy == "auto" else float(config.target_entropy)
        m = module
        self.q_opt = torch.optim.Adam([*m.qf_encoder.parameters(), *m.qf.parameters()], lr=config.critic_lr, eps=1e-7)
        self.q2_opt = torch.optim.Adam([*m.qf_twin_encoder.parameters(), *m.qf_twin.parameters()], lr=config.critic_lr,
                                       eps=1e-7)
        self.pi_opt = torch.optim.Adam([*m.pi_encoder.parameters(), *m.pi.parameters()], lr=config.actor_lr, eps=1e-7)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=config.alpha_lr, eps=1e-7)

    def _q(self, encoder, head, obs, actions) -> torch.Tensor:
        return head(encoder({Columns.OBS: obs, Columns.ACTIONS: actions})[ENCODER_OUT]).squeeze(-1)

    def _policy(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised tanh-squashed Gaussian action in [-1, 1] and its log-probability."""
        loc, log_std = self.m.pi(self.m.pi_encoder({Columns.OBS: obs})[ENCODER_OUT]).chunk(2, dim=-1)
        std = log_std.clamp(MIN_LOG_NN_OUTPUT, MAX_LOG_NN_OUTPUT).exp()
        u = loc + std * torch.randn_like(loc)
        logp = torch.distributions.Normal(loc, std).log_prob(u).sum(-1)
        logp = logp - (2.0 * (math.log(2.0) - u - torch.nn.functional.softplus(-2.0 * u))).sum(-1)
        return torch.tanh(u), logp

    def update(self, b: dict[str, torch.Tensor]) -> None:
        m, alpha = self.m, self.log_alpha.exp().detach()
        with torch.no_grad():
            next_actions, next_logp = self._policy(b["new_obs"])
            q_next = torch.min(self._q(m.target_qf_encoder, m.target_qf, b["new_obs"], next_actions),
                               self._q(m.target_qf_twin_encoder, m.target_qf_twin, b["new_obs"], next_actions))
            target = b["rewards"] + self.gamma ** b["n_step"] * (1.0 - b["terminateds"].float()) * (
                q_next - alpha * next_logp)
        q1 = self._q(m.qf_encoder, m.qf, b["obs"], b["actions"])
        q2 = self._q(m.qf_twin_encoder, m.qf_twin, b["obs"], b["actions"])
        critic_loss = (b["weights"] * _huber(q1, target)).mean() + (b["weights"] * _huber(q2, target)).mean()
        self.q_opt.zero_grad()
        self.q2_opt.zero_grad()
        critic_loss.backward()
        self.q_opt.step()
        self.q2_opt.step()

        actions, logp = self._policy(b["obs"])
        q_pi = torch.min(self._q(m.qf_encoder, m.qf, b["obs"], actions),
                         self._q(m.qf_twin_encoder, m.qf_twin, b["obs"], actions))
        actor_loss = (alpha * logp - q_pi).mean()
        self.pi_opt.zero_grad()
        actor_loss.backward()
        self.pi_opt.step()
        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad()
        alpha_loss.backward()
        self.alpha_opt.step()

    def update_target(self) -> None:
        for main, target in self.m.get_target_network_pairs():
            _polyak(main, target, self.tau)


class PlainDQN:
    def __init__(self, module: Any, config: Any) -> None:
        if module.uses_dueling or config.num_atoms > 1:
            raise ValueError("the plain-torch DQN is the expectation, non-dueling one")
        self.m, self.gamma, self.tau, self.double_q = module, config.gamma, config.tau, config.double_q
        (_, self.target_encoder), (_, self.target_af) = module.get_target_network_pairs()
        self.grad_clip = config.grad_clip
        self.params = [*module.encoder.parameters(), *module.af.parameters()]
        self.opt = torch.optim.Adam(self.params, lr=config.lr)
        self.loss = torch.nn.HuberLoss(reduction="none") if config.td_error_loss_fn == "huber" else torch.nn.MSELoss(
            reduction="none")

    def _q(self, encoder, head, obs) -> torch.Tensor:
        return head(encoder({Columns.OBS: obs})[ENCODER_OUT])

    def update(self, b: dict[str, torch.Tensor]) -> None:
        m = self.m
        with torch.no_grad():
            q_next_target = self._q(self.target_encoder, self.target_af, b["new_obs"])
            chooser = self._q(m.encoder, m.af, b["new_obs"]) if self.double_q else q_next_target
            q_next = q_next_target.gather(-1, chooser.argmax(-1, keepdim=True)).squeeze(-1)
            target = b["rewards"] + self.gamma ** b["n_step"] * (1.0 - b["terminateds"].float()) * q_next
        q = self._q(m.encoder, m.af, b["obs"]).gather(-1, b["actions"].long().unsqueeze(-1)).squeeze(-1)
        loss = (b["weights"] * self.loss(q, target)).mean()
        self.opt.zero_grad()
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()

    def update_target(self) -> None:
        for main, target in self.m.get_target_network_pairs():
            _polyak(main, target, self.tau)
