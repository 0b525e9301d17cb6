# One image for every callgate worker; docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY callgate ./callgate
COPY ingest ./ingest
COPY normalizer ./normalizer
COPY validator ./validator
COPY executor ./executor
COPY schemas ./schemas
COPY policies ./policies
COPY fixtures ./fixtures
RUN pip install --no-cache-dir .
ENV CALLGATE_TOOLS_DIR=/app/schemas/tools CALLGATE_POLICIES_DIR=/app/policies
ENTRYPOINT ["callgate"]
