"""The network monitor (paper §4): every t_lag seconds each rank's daemon reports its NIC's
available rate per direction and the bytes it moved (achieved rate = bytes over the interval); the
scheduler plans on the last reports (so it sees the network t_lag late, as in the paper).

On this machine the available rate is the emulated NIC's current rate (mlfabric.emulate), which is
what a real monitor estimates; without emulation links are not paced and the scheduler plans with
UNPACED bytes/s everywhere.
"""
UNPACED = 1e12  # bytes/s assumed for a link with no pacing (far beyond any real link)


class Reporter:
    """A rank's side: due() says when a report is owed; report() makes one."""

    def __init__(self, nic, t_lag):
        self.nic, self.t_lag = nic, t_lag
        self.next = 0.0
        self.last = (None, 0, 0)  # (time, bytes out, bytes in) of the last report

    def due(self, now):
        return now >= self.next

    def report(self, now):
        """(available egress, available ingress, achieved out, achieved in), bytes/s; the
        achieved rates are over the time since the last report (0 for the first)."""
        nic = self.nic
        t, o, i = self.last
        dt = now - t if t is not None and now > t else None
        self.last = (now, nic.bytes_out, nic.bytes_in)
        self.next = now + self.t_lag
        e, g = nic.egress_rate(now), nic.ingress_rate(now)
        return (UNPACED if e is None else e, UNPACED if g is None else g,
                (nic.bytes_out - o) / dt if dt else 0.0, (nic.bytes_in - i) / dt if dt else 0.0)


class ReportedCapacities:
    """The scheduler's side, in the form mlfabric.sched.view.SchedulerView reads (a 'truth' whose
    capacities are the last reports, whatever the time asked: the lag is real here)."""

    def __init__(self, hosts, initial):
        self.hosts = hosts
        self.caps = [float(initial)] * (2 * hosts)
        self.achieved = {}  # rank -> (out, in) bytes/s in its last report

    def update(self, rank, egress, ingress, out=0.0, into=0.0):
        self.caps[rank] = float(egress)
        self.caps[self.hosts + rank] = float(ingress)
        self.achieved[rank] = (out, into)

    def capacities(self, t):
        return self.caps

    def capacity(self, link, t):
        return self.caps[link]
