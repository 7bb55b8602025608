"""Stop signals (SIGTERM, SIGUSR1, Ctrl-C): a save and a clean exit, agreed by every rank."""

import os
import signal

import torch
import torch.distributed as dist


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

    def agreed(self, device) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signal_name is not None
        flag = torch.tensor(float(self.signal_name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
