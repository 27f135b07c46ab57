# Airflow 3 with this provider, Java for spark-submit, and the Sequin CLI (used by docker-compose.yaml).
# The provider is installed as a wheel (not editable): the Spark apps the operators submit are inside it.
FROM apache/airflow:3.3.2-python3.11
USER root
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64
USER airflow
COPY --chown=airflow:root requirements.lock pyproject.toml setup.py README.md /opt/sequin/
COPY --chown=airflow:root sequin_provider /opt/sequin/sequin_provider
RUN pip install --no-cache-dir "pyspark==4.2.0" "pyspark-client==4.2.0" \
    && pip install --no-cache-dir --no-deps /opt/sequin \
    && pip install --no-cache-dir psycopg-pool "psycopg[binary]" psycopg2-binary pyyaml pyarrow fastapi uvicorn httpx
ENV PYSPARK_PYTHON=/home/airflow/.local/bin/python
