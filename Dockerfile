# Two images. CI runs the same install commands (.ci/check-hub-install.sh, Makefile), since
# no Docker engine runs there.
#   docker build --target hub -t weightsync-hub .
#   docker run -p 8000:8000 -v /srv/weightsync:/data -e SYNC_TOKEN=... weightsync-hub
#   docker build --target trainer -t weightsync-trainer .

FROM python:3.11-slim AS hub
WORKDIR /app
COPY pyproject.toml README.md ./
COPY syncwire syncwire
COPY syncserver syncserver
COPY syncclient syncclient
COPY weightsync_run weightsync_run
# the hub needs no torch: the server extra alone
RUN pip install --no-cache-dir '.[server]' \
 && useradd --create-home --uid 10001 hub \
 && mkdir -p /data && chown hub /data
USER hub
ENV SYNC_DATA_DIR=/data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --retries=3 \
  CMD python -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/healthz').status_code != 200)"
CMD ["uvicorn", "syncserver.app:app", "--host", "0.0.0.0", "--port", "8000"]

FROM python:3.11-slim AS trainer
WORKDIR /app
# torch first, pinned, so nothing later pulls another build (use your CUDA wheel index on GPU VMs)
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY syncwire syncwire
COPY syncserver syncserver
COPY syncclient syncclient
COPY weightsync_run weightsync_run
COPY train train
RUN pip install --no-cache-dir '.[train]' && useradd --create-home --uid 10001 trainer
USER trainer
ENTRYPOINT ["python", "train/finetune_gpt2.py"]
