"""Stop signals (SIGTERM, SIGUSR1, Ctrl-C): a save and a clean exit, agreed by every rank."""

import os
import signal

# Imported before torch by train.py, so that remember_stop_signals() comes first: torch is
# imported where it is used.
_early: list[str] = []  # stop signals received before a StopRequest was entered


def remember_stop_signals() -> None:
    """train.py calls this before its imports (seconds, and more before the loop starts): a
    SIGTERM or SIGUSR1 then (SLURM's warning, a requeue) is remembered and taken over by the
    StopRequest, instead of killing the process before it could save (-15, or a torchrun
    ChildFailedError)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: _early.append(signal.Signals(signum).name))
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # from torchrun (scripts/lib/torchrun.sh)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C aborts the imports


class StopRequest:
    """SIGTERM / SIGUSR1 (what SLURM sends before a time limit) and a first SIGINT (Ctrl-C) ask
    for a save and a clean exit; a second SIGINT aborts at once (KeyboardInterrupt). Ranks agree
    on when to stop at log steps (one all-reduce there, no extra host sync). A context manager:
    the previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, saves: bool = True):
        self.signal_name = None
        self.saves = saves
        self._sigint_seen = False
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        if _early:  # after the handlers are set: no signal falls in between
            self.signal_name = _early[-1]
            _early.clear()  # taken over once
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # None: a handler not set from Python, cannot be restored
                signal.signal(sig, handler)

    def _handler(self, signum, frame):
        if signum == signal.SIGINT:
            if self._sigint_seen:
                raise KeyboardInterrupt
            self._sigint_seen = True
            if int(os.environ.get("RANK", "0")) == 0:  # os.write: print() is unsafe in a handler
                os.write(2, ("\nSIGINT: " + ("saving and stopping" if self.saves else "stopping")
                             + " after this step (several processes: at the next log step); "
                             "Ctrl-C again aborts at once\n").encode())
        self.signal_name = signal.Signals(signum).name

    def stopped_line(self, step: int, checkpoint=None) -> str:
        """What the run says when it stops for the request, after step (and the checkpoint it
        saved there, if any)."""
        return (f"received {self.signal_name or 'a stop request on another rank'}: stopped after "
                f"step {step}" + (f", checkpoint in {checkpoint}; the same command resumes"
                                  if checkpoint is not None else ""))

    def agreed(self, device, ranks_talk: bool = True) -> bool:
        """Whether to stop after this step. Every rank calls it after every step, with the same
        ranks_talk. One process answers from its own signals at once. Several must agree (a
        signal may reach some ranks only): in one all-reduce, which runs only where ranks_talk
        (the trainer passes its log steps, where the host waits for the device anyway); on the
        other steps the answer is False, and a signal takes effect at the next log step."""
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signal_name is not None
        if not ranks_talk:
            return False
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
