"""A dependency-free progress bar for long runs (training, benchmarks): redrawn in place on a
terminal, one line per tenth of the work otherwise (CI logs stay short)."""
import sys
import time


class Progress:
    def __init__(self, total, label="", stream=None, width=30, enabled=True):
        self.total, self.label, self.width = max(1, int(total)), label, width
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done, self.t0, self.shown = 0, time.monotonic(), -1

    def update(self, n=1, **info):
        """Advance by n; `info` (e.g. loss=0.12, acc=0.97) is shown after the bar."""
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        tenth = self.done * 10 // self.total
        if not self.tty and tenth == self.shown and self.done < self.total:
            return
        self.shown = tenth
        frac = self.done / self.total
        elapsed = time.monotonic() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        extra = " ".join("%s %s" % (k, _fmt(v)) for k, v in info.items())
        line = "%s [%s] %d/%d %.1fs (eta %.1fs) %s" % (self.label, bar, self.done, self.total,
                                                       elapsed, eta, extra)
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _fmt(v):
    return "%.4g" % v if isinstance(v, float) else str(v)
