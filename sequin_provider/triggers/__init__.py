"""Deferrable triggers of the Sequin provider (run in the Airflow triggerer)."""
