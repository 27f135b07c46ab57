"""Airflow hooks of the Sequin provider."""
