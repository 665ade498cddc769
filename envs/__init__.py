"""Our Gymnasium environments, registered under the `rlplatform/` namespace on import.

The project keeps them in its top-level `envs/` folder, installed as the package
`rlplatform_envs` (a name of our own, not a global `envs`). Experiment files name them
`rlplatform/<Name>-v<N>`; the platform passes them to Ray's env runners as
`rlplatform_envs:rlplatform/...` so that every worker, on any node, imports this package and
sees the same registrations.
"""

from gymnasium.envs.registration import register, registry

# id -> (entry point, max episode steps, multi-agent)
ENVS = {
    "rlplatform/CostlySim-v0": ("rlplatform_envs.costly_sim:CostlySimEnv", 200, False),
    "rlplatform/PixelCatch-v0": ("rlplatform_envs.pixel_catch:PixelCatchEnv", None, False),
    "rlplatform/Atari-v0": ("rlplatform_envs.atari:make_atari", None, False),
    "rlplatform/Faulty-v0": ("rlplatform_envs.faults:make_faulty", None, False),
    "rlplatform/Firehose-v0": ("rlplatform_envs.firehose:FirehoseEnv", None, False),
    "rlplatform/Pursuit-v0": ("rlplatform_envs.pursuit:PursuitEnv", None, True),
    "rlplatform/MaskedPick-v0": ("rlplatform_envs.masked_pick:MaskedPickEnv", None, False),
    "rlplatform/PettingZooParallel-v0": ("rlplatform_envs.pettingzoo_envs:make_parallel", None, True),
}
MULTI_AGENT = {env_id for env_id, (_, _, multi_agent) in ENVS.items() if multi_agent}

for _env_id, (_entry_point, _max_steps, _multi_agent) in ENVS.items():
    if _env_id not in registry:
        # RLlib's MultiAgentEnv is not a plain gymnasium env: no checker, no order enforcing.
        register(id=_env_id, entry_point=_entry_point, max_episode_steps=_max_steps,
                 disable_env_checker=_multi_agent, order_enforce=not _multi_agent)
