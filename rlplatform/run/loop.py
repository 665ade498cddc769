"""The training loop, read top to bottom: build the algorithm where the plan says, then per iteration
train, log, print, check the stop criteria and checkpoint; signals finish the iteration and checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rlplatform import console
from rlplatform.config.schema import ExperimentConfig
from rlplatform.errors import TrainingFailed
from rlplatform.run import progress
from rlplatform.run import run_dir as rundir
from rlplatform.run.checkpoints import CheckpointInfo, CheckpointManager
from rlplatform.run.plan import Plan

if TYPE_CHECKING:
    from rlplatform.run.algorithm_host import Host
    from rlplatform.run.metrics import RunLogger

STALL_TIMEOUT_S = 300.0
# A process that a shell exec'd keeps the shell's creation time (`bash -c 'pip install ... && python -metrics
# rlplatform train'` runs its last command in bash's own process), while Python reaches this package
# within tens of milliseconds of its start: a creation time older than that by more is the shell's.
EXEC_GRACE_S = 1.0


class StopFlag:
    """SIGINT/SIGTERM: finish the iteration, checkpoint, exit 0. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        console.stdout.print(f"[yellow]{self.reason}: finishing this iteration, then checkpointing[/]")

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def stop_reason(config: ExperimentConfig, metrics: dict[str, Any], window_full: bool, wall_s: float) -> Optional[str]:
    """`window_full`: the 100-episode window is; an offline run (no episodes of its own) goes by its latest evaluation."""
    stop = config.stop
    key, ready = ("eval/return_mean", True) if config.data is not None else ("return/mean", window_full)
    if stop.return_mean is not None and ready and metrics.get(key, float("-inf")) >= stop.return_mean:
        return f"{key} {metrics[key]:.2f} >= {stop.return_mean:g}"
    if stop.env_steps is not None and metrics["env_steps"] >= stop.env_steps:
        return f"env steps {metrics['env_steps']:,} >= {stop.env_steps:,}"
    if stop.iterations is not None and metrics["iteration"] >= stop.iterations:
        return f"iterations {metrics['iteration']} >= {stop.iterations}"
    if stop.wall_time_s is not None and wall_s >= stop.wall_time_s:
        return f"wall time {wall_s:.0f} s >= {stop.wall_time_s:g} s"
    return None


class RunSession:
    """A run between iterations: the algorithm host, the 100-episode window, the logger, the system monitor and
    the checkpoints. `train_loop` drives one until a stop reason; a Tune trial (`run/trial.py`) drives one an
    iteration per Tune step. Either way the run directory is written the same way."""

    def __init__(self, plan: Plan, started: float, resume_from: Optional[CheckpointInfo] = None,
                 record_placement: bool = True, hparams: Optional[dict[str, Any]] = None) -> None:
        from rlplatform.infra.system_monitor import SystemMonitor
        from rlplatform.run.metrics import EpisodeWindow, RunLogger

        self.plan, self.config, self.run_dir, self.started = plan, plan.config, plan.require_run_dir(), started
        self.host: Optional[Host] = _start_host(plan, resume_from, record_placement=record_placement)
        self.window, self.wall_before = EpisodeWindow(), 0.0
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", self.config.checkpoint.keep_last,
                                             self.config.checkpoint.keep_best)
        purge_step = None
        if resume_from:
            self.window = EpisodeWindow.from_state(resume_from.meta.get("episode_window"))
            self.wall_before = float(resume_from.meta.get("wall_time_s", 0.0))
            purge_step = _rewind(self.run_dir, resume_from, self.checkpoints)
        self._hparams = hparams
        self.logger = RunLogger(self.run_dir, self.config, fresh=resume_from is None, purge_step=purge_step, hparams=hparams)
        self.monitor = SystemMonitor(object_store=self.config.speedups)
        self.stall = StallGuard()
        self.last: Optional[dict[str, Any]] = None
        self.restarts: list[dict[str, Any]] = []

    def iterate(self) -> dict[str, Any]:
        """One training step: the algorithm's result in our tags, with the window, the system readings and the
        wall time, logged. Raises HostFailed when the step fails (see `restart`)."""
        metrics = self._live_host().call("train")
        self.window.add(metrics.pop("episode_returns"), metrics.pop("episode_lengths"))
        wall_s = self.wall_before + time.time() - self.started
        metrics.update(self.window.summary(), **self.monitor.sample(), wall_time_s=wall_s, timestamp=time.time())
        if self.config.max_failures:
            metrics["faults/run_restarts"] = len(self.restarts)
        self.logger.log(metrics)
        self.last = metrics
        self.stall.update(metrics)
        return metrics

    def _live_host(self) -> Host:
        if self.host is None:
            raise TrainingFailed("the algorithm is gone: its host was closed")
        return self.host

    def stop_reason(self, metrics: dict[str, Any]) -> Optional[str]:
        return stop_reason(self.config, metrics, self.window.full, metrics["wall_time_s"])

    def restart(self, exc: BaseException) -> None:
        """The training step failed: rebuild the algorithm from the newest checkpoint that verifies (within
        `max_failures`), else raise TrainingFailed."""
        from rlplatform.run.metrics import EpisodeWindow, RunLogger

        if len(self.restarts) >= self.config.max_failures:
            raise TrainingFailed(str(exc) if not self.restarts else f"{exc} (after {len(self.restarts)} restart(s))") from None
        self._live_host().close()
        self.host = None
        resume_from = _record_restart(self.run_dir, self.restarts, exc, self.config.max_failures)
        self.host = _start_host(self.plan, resume_from)
        _close_quietly(self.logger)
        purge_step = _rewind(self.run_dir, resume_from, self.checkpoints)
        self.logger = RunLogger(self.run_dir, self.config, fresh=False, purge_step=purge_step)
        self.window = EpisodeWindow.from_state(resume_from.meta.get("episode_window") if resume_from else None)
        self.stall = StallGuard()

    def save(self, metrics: dict[str, Any]) -> Path:
        """A complete-or-nothing checkpoint of iteration `metrics`; a write that fails ends the run (TrainingFailed)."""
        from rlplatform.run.algorithm_host import HostFailed

        try:
            return self.checkpoints.save(
                lambda path: self._live_host().call("save", path),
                iteration=metrics["iteration"], env_steps=metrics["env_steps"], score=_score(metrics),
                meta={"wall_time_s": metrics["wall_time_s"], "episode_window": self.window.state(),
                      "config": self.config.model_dump()},
            )
        except (OSError, HostFailed) as exc:
            raise TrainingFailed(_checkpoint_failed(f"checkpoint {metrics['iteration']} could not be written", exc, self.checkpoints)) from None

    def check_learners(self) -> None:
        """Several learners all-reduce every step, so they must end with the same weights: compared and recorded
        (manifest `learners`); a mismatch is said, not raised (the run's checkpoints hold learner 0's weights)."""
        digests = self._live_host().call("learner_weights")
        equal = len(set(digests)) == 1
        rundir.record_start(self.run_dir, "learners", {"count": len(digests), "weights_equal": equal, "digests": digests})
        if equal:
            console.say(f"learners: {len(digests)}, the same weights (SHA-256 {digests[0][:12]})")
        else:
            console.say(f"warning: the {len(digests)} learners ended with different weights: {', '.join(d[:12] for d in digests)}",
                        style="bold red")

    def close(self, saved: Optional[Path] = None, failed: bool = False) -> None:
        self.logger.finish(saved, failed=failed)
        _close_quietly(self.logger)  # on a full disk its last flush fails too; the run's outcome is said elsewhere
        self.monitor.stop()
        if self.host is not None:
            self.host.close()
            self.host = None


def train_loop(plan: Plan) -> int:
    from rlplatform.run.algorithm_host import HostFailed

    config, run_dir = plan.config, plan.require_run_dir()
    started = command_start_time()  # wall time counts from the command's start, Ray start-up included
    progress.print_start(run_dir, config, plan.resources.describe())
    if plan.layout_note:
        console.say(plan.layout_note)
    if plan.envs_note:
        console.say(plan.envs_note, style="dim")
    session = RunSession(plan, started, plan.resume_from)
    stop_flag = StopFlag()
    startup: Optional[dict[str, float]] = {"ray_ready_s": (plan.ray_ready_at or started) - started, "algorithm_ready_s": time.time() - started}
    saved: Optional[Path] = None
    reason = None
    try:
        while reason is None:
            try:
                metrics = session.iterate()
            except HostFailed as exc:
                session.restart(exc)
                continue
            progress.print_iteration(metrics, config.scale.env_runners)
            if startup is not None:  # the first iteration
                _record_startup(run_dir, startup, metrics, time.time() - started)
                startup = None
            reason = session.stop_reason(metrics) or stop_flag.reason
            every = config.checkpoint.every
            if reason is not None or (every and metrics["iteration"] % every == 0):
                saved = session.save(metrics)
        if config.scale.learners > 1:
            session.check_learners()
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        raise TrainingFailed(_checkpoint_failed("cannot write to the run directory", exc, session.checkpoints)) from None
    finally:
        stop_flag.restore()
        session.close(saved, failed=sys.exc_info()[0] is not None)  # trackers: artefacts, final checkpoint, status
    progress.print_summary(run_dir, reason, session.last, saved, time.time() - started)
    return 0


def _start_host(plan: Plan, resume_from: Optional[CheckpointInfo], record_placement: bool = False) -> Host:
    """Build the algorithm where the plan says and restore it from `resume_from` (a CheckpointInfo or None)."""
    from rlplatform.run import algorithm_host
    from rlplatform.run.algorithm_host import HostFailed

    host = None
    # `init_from` gives a fresh run its first weights; a restored one has its own.
    config = plan.config if resume_from is None else plan.config.model_copy(update={"init_from": None})
    try:
        host = algorithm_host.start(config, plan.bundles, plan.main_process_resources, plan.resources.describe(),
                                    in_driver=plan.algorithm_in_driver)
        if config.init_from:
            _say_init_from(plan.require_run_dir(), config.init_from, host.call("initialized_from"))
        if record_placement:
            rundir.record_start(plan.require_run_dir(), "placement", {"algorithm_node": host.call("node_id"), "algorithm_in": host.where,
                                                            "env_runner_nodes": host.call("env_runner_nodes"),
                                                            "learner_nodes": host.call("learner_nodes")})
        if resume_from:
            _say_replay_buffer(host.call("restore", str(resume_from.path.resolve())).get("replay_buffer"))
    except HostFailed as exc:
        if host is not None:
            host.close()
        raise TrainingFailed(f"the algorithm could not be built: {exc}") from None
    return host


def _say_init_from(run_dir: Path, checkpoint: str, tensors: list[str]) -> None:
    rundir.record_start(run_dir, "init_from", {"checkpoint": checkpoint, "tensors": tensors})
    console.say(f"init_from: {len(tensors)} tensors of the policy from {checkpoint}")


def _say_replay_buffer(state: Optional[dict[str, Any]]) -> None:
    if state is None:
        return
    if state["saved"]:
        console.say(f"replay buffer: {state['transitions']:,} transitions restored from the checkpoint")
    else:
        console.say("replay buffer: starts empty (RLlib's own buffers are not in its checkpoints; with "
                     "`speedups: true` single-agent DQN and SAC keep theirs)")


def _record_restart(run_dir: Path, restarts: list[dict[str, Any]], exc: BaseException,
                    max_failures: int) -> Optional[CheckpointInfo]:
    """The training step failed: note it in the manifest and pick the newest checkpoint that verifies and loads
    (None: no checkpoint yet, the run starts over)."""
    from rlplatform.errors import UserError
    from rlplatform.run.plan import checkpoint_to_resume

    try:
        resume_from = checkpoint_to_resume(run_dir)
    except UserError:
        resume_from = None
    restarts.append({"at": time.strftime("%Y-%metrics-%dT%H:%M:%S%z"), "error": str(exc),
                     "from_iteration": resume_from.iteration if resume_from else 0})
    rundir.record_start(run_dir, "restarts", restarts)
    console.say(f"the training step failed: {exc}; restart {len(restarts)} of at most {max_failures}, "
                 f"from {resume_from.path if resume_from else 'the start (no checkpoint yet)'}")
    return resume_from


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _checkpoint_failed(what: str, exc: BaseException, checkpoints: CheckpointManager) -> str:
    """A write that failed (disk full, quota, read-only) ends the run: training on would lose what it
    learns, since nothing more can be saved. A checkpoint's partial directory is gone; earlier ones are whole."""
    from rlplatform.run.checkpoints import list_checkpoints

    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    written = list_checkpoints(checkpoints.directory)
    latest = written[-1].path if written else "none"
    return f"{what} ({cause}); the run stops here, the checkpoints written before are intact (latest: {latest})"


def _close_quietly(logger: RunLogger) -> None:
    try:
        logger.close()
    except OSError:
        pass


def _rewind(run_dir: Path, resume_from: Optional[CheckpointInfo], checkpoints: CheckpointManager) -> int:
    """Every chart and table shows each iteration once: what the iterations after the checkpoint (after none:
    every iteration, when the run starts over) wrote is set aside (metrics rows, checkpoints) or hidden
    (TensorBoard events, by the returned purge step)."""
    from rlplatform.run.metrics import ROLLED_BACK_FILE, rewind_record

    k = resume_from.iteration if resume_from else 0
    rows, moved = rewind_record(run_dir, k), checkpoints.roll_back_after(k)
    if resume_from:
        console.say(f"resumed from {resume_from.path} (iteration {k})")
    if rows or moved:
        console.say(f"rolled back what came after iteration {k}: {rows} metrics row(s) to {ROLLED_BACK_FILE}, "
                     f"{len(moved)} checkpoint(s) to checkpoints/rolled_back/")
    return resume_from.env_steps + 1 if resume_from else 0


def _record_startup(run_dir: Path, startup: dict[str, float], first: dict[str, Any], now_s: float) -> None:
    """Where the time before training went, from the command's start (read by `bench solve`)."""
    startup = {**startup, "first_sample_s": startup["algorithm_ready_s"] + (first.get("time/sample_s") or 0.0),
               "first_iteration_s": now_s}
    rundir.record_start(run_dir, "startup", startup)
    console.say(
        f"start-up: Ray ready {startup['ray_ready_s']:.1f} s, algorithm built {startup['algorithm_ready_s']:.1f} s, "
        f"first batch sampled {startup['first_sample_s']:.1f} s after the command started", style="dim")


class StallGuard:
    """Fail a run whose env runners keep dying before they sample anything, instead of looping forever."""

    def __init__(self, timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._steps = -1
        self._since = time.time()

    def update(self, metrics: dict[str, Any]) -> None:
        if metrics["env_steps"] > self._steps:
            self._steps, self._since = metrics["env_steps"], time.time()
        elif time.time() - self._since > self.timeout_s:
            healthy = metrics.get("faults/healthy_env_runners")
            raise TrainingFailed(
                f"no env steps sampled for {self.timeout_s:.0f} s (healthy env runners: {healthy}); "
                "the env or its runners keep failing - see the worker logs under Ray's session directory"
            )


def command_start_time() -> float:
    """time.time() when this command started, the interpreter's own start-up included."""
    import rlplatform

    created = _process_creation_time()
    return created if rlplatform.IMPORTED_AT - created < EXEC_GRACE_S else rlplatform.IMPORTED_AT


def _process_creation_time() -> float:
    # psutil adds the start tick to /proc/stat's boot time, a whole second: up to 1 s early (0.65 s on
    # this machine). The process's age on the boot clock is exact to the tick (10 ms).
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, AttributeError, ValueError, IndexError):  # no /proc or no boot clock: not Linux
        import psutil

        return psutil.Process().create_time()


def _score(metrics: dict[str, Any]) -> Optional[float]:
    return metrics.get("eval/return_mean", metrics.get("return/mean"))
