"""spark-submit entry point of the long-lived replication stream app (DESIGN §6).

    spark-submit $(python -c 'import sequin_provider.spark_apps as a; print(a.APPS_DIR)')/replication_stream.py \
        --config sequin.yaml [--database app]
    python -m sequin_provider.spark_apps.replication_stream --config sequin.yaml   # local Spark

Only parses arguments and calls into the package. In a source checkout, ``spark_apps/replication_stream.py``
is a shim calling ``main``.
"""

from __future__ import annotations

import argparse
import sys

from sequin_provider.spark.app import run_stream_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sequin replication stream app")
    parser.add_argument("--config", default=None, help="sequin.yaml (default: $SEQUIN_CONFIG or ./sequin.yaml)")
    parser.add_argument("--database", default=None, help="database name from the config (default: the only one)")
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint folder (default: stream.checkpoint_location/<database>)"
    )
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit")
    args = parser.parse_args(argv)
    return run_stream_app(args.config, args.database, args.checkpoint, args.master)


if __name__ == "__main__":
    sys.exit(main())
