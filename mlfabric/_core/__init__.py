"""Private plumbing below the transports: settings, wire dtypes, buffer and device-array views,
the bounded exit, a progress bar. Nothing here talks to MPI or imports from the layers above."""
