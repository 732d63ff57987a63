"""The divergence gate of one server with a replica: for each of the server's commits, in order,
how many updates the replica must have applied before the server may apply it, so that at every
instant ||w_server - w_replica|| <= Div_max.

With gamma = 0 (the modes that replicate apply updates one by one without momentum) the models
differ by the sum of the updates the replica has not applied yet (the lead), so the eq. 11 bound is
the sum of their norms; the gate keeps that sum <= Div_max after every server commit. The paper
checks the bound only at the end of a batch (T_last, §5.3) and lets it be exceeded in between; a
server can die at any instant, and the bound must hold when it does, so here it holds at every
commit. The plan's own catch-up (replicate() freezing replica transfers and delaying the server's
last one) is what normally keeps the gate from making the server wait.
"""

class DivergenceGate:
    def __init__(self, div_max):
        self.div_max = div_max
        self.prefix = [0.0]    # prefix[p] = sum of the norms of the first p updates, server order
        self.low = 0           # smallest replica position still allowed (non-decreasing)

    def commit(self, norms):
        """Book the next commit's members' norms; returns the replica count it must wait for."""
        for n in norms:
            self.prefix.append(self.prefix[-1] + n)   # finite: push() refuses NaN and inf
        p, prefix = len(self.prefix) - 1, self.prefix
        while prefix[p] - prefix[self.low] > self.div_max and self.low < p:
            self.low += 1
        return self.low
