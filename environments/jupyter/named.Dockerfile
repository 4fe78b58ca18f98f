# A named image (`nbexec image build --name NAME`): the runtime image, or another named image, plus the operator's
# Debian packages and Python requirements. nbexec checked both lists before the build (nbexec/sandbox/docker/recipe.py);
# they arrive here as files, read by xargs and pip -r, never spliced into a command line. The runtime image's
# hardening is applied again after the installs: set-id bits stripped, the non-root user, tini, the kernel entrypoint.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
USER 0:0

COPY apt.txt ca-bundle.crt /opt/nbexec/named/
RUN if [ -s /opt/nbexec/named/apt.txt ]; then \
        apt-get update \
     && xargs -a /opt/nbexec/named/apt.txt apt-get install -y --no-install-recommends \
     && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi

# The kernel must still start: ipykernel and nbexec's display hook import after pip changed the venv.
COPY requirements.txt /opt/nbexec/named/
RUN if [ -s /opt/nbexec/named/requirements.txt ]; then \
        if [ -s /opt/nbexec/named/ca-bundle.crt ]; then export PIP_CERT=/opt/nbexec/named/ca-bundle.crt; \
        elif [ -f /opt/nbexec/ca/ca-bundle.crt ]; then export PIP_CERT=/opt/nbexec/ca/ca-bundle.crt; fi \
     && pip install --no-compile -r /opt/nbexec/named/requirements.txt \
     && python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null; \
    fi \
 && python -c "import ipykernel, matplotlib_inline, nbexec_display"

RUN (find / -xdev -perm /6000 -type f -exec chmod a-s {} + 2>/dev/null || true) \
 && find /opt/nbexec \( -type d ! -perm -o+rx -o -type f ! -perm -o+r -o -type f -perm /u+x ! -perm -o+x \) \
        -exec chmod a+rX {} +
USER 1000:1000
ENV HOME=/home/sandbox
WORKDIR /mnt/data
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["nbexec-kernel", "/run/nbexec/kernel.json"]
