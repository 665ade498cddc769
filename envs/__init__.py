"""Our Gymnasium environments, registered under the `rlplatform/` namespace on import.

Experiment files name them `rlplatform/<Name>-v<N>`; the platform passes them to Ray's
env runners as `envs:rlplatform/...` so that every worker, on any node, imports this
package and sees the same registrations.
"""

from gymnasium.envs.registration import register, registry

_ENVS = {
    "rlplatform/CostlySim-v0": ("envs.costly_sim:CostlySimEnv", 200),
}

for _env_id, (_entry_point, _max_steps) in _ENVS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point=_entry_point, max_episode_steps=_max_steps)
