"""Prometheus metrics of the stream app, the backfill server and the pull API (docs/metrics.md).

- ``core``: what the three share: a histogram fed many observations at once (``WeightedHistogram``),
  the ``/metrics`` HTTP server of a Spark app (``serve_metrics``), bounded store reads at scrape time;
- ``stream``: the stream app's (driver side: fed by each micro-batch's reports, never by executors);
- ``api``: the pull API's (counted in the API process; outstanding messages read from the store);
- ``backfill``: the backfill server's (read from the store's backfills table at scrape time).

Nothing here does I/O at import or when a registry is made: the store and the source are read
only while a scrape runs, with short timeouts.
"""
