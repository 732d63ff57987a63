"""Checkpoint-to-disk: the baseline recovery that in-network replication is compared with (paper
§7: checkpointing every 30 / 600 updates). A server with checkpoint_every=K writes its model and
version every K updates; a job started with resume=True has each server start from its last
checkpoint. Writes are atomic (a temporary file renamed over the old one), so a server killed
mid-write leaves the previous checkpoint intact.
"""
import os

import numpy as np


def path(directory, server):
    return os.path.join(directory, "server-%d.npz" % server)


def save(directory, server, model, version):
    """Write server `server`'s model and version; returns the bytes written."""
    os.makedirs(directory, exist_ok=True)
    final = path(directory, server)
    tmp = final + ".tmp.npz"
    np.savez(tmp, model=model, version=np.int64(version))
    os.replace(tmp, final)
    return os.path.getsize(final)


def load(directory, server):
    """(model, version) of server `server`'s last checkpoint, or None if there is none."""
    p = path(directory, server)
    if not os.path.exists(p):
        return None
    with np.load(p) as f:
        return f["model"], int(f["version"])
