# Kernels besides Python on an nbexec runtime image: R (IRkernel), TypeScript/JavaScript (Deno) and Bash
# (bash_kernel), each installed only when KERNELS lists it. No container registry is needed: R comes from Debian's
# apt, Deno and bash_kernel from PyPI (Deno's wheel carries the binary). Each kernel has a launcher,
# /usr/local/bin/nbexec-kernel-NAME CONNECTION_FILE, that binds the unix sockets /run/nbexec/kernel-1 .. kernel-5
# exactly as nbexec-kernel (ipykernel) does, so the host connects the same way.
#
#   docker build -f kernels.Dockerfile --build-arg BASE_IMAGE=nbexec-jupyter:latest \
#       --build-arg KERNELS=r,deno,bash -t nbexec-jupyter:kernels .
#
# The runtime image's hardening is applied again after the installs: set-id bits stripped, the non-root user,
# tini, the Python kernel as the default command (the host names the launcher of the kernel it wants).
ARG BASE_IMAGE=nbexec-jupyter:latest
FROM ${BASE_IMAGE}
USER 0:0

ARG KERNELS=r,deno,bash
# Pinned: Deno and bash_kernel from PyPI, R and IRkernel as Debian bookworm ships them (a Debian point release may
# replace a version; pass the new one as a build argument).
ARG DENO_VERSION=2.9.8
ARG BASH_KERNEL_VERSION=0.10.0
ARG R_VERSION=4.2.2.20221110-2
ARG IRKERNEL_VERSION=1.3.2-1

RUN for k in $(echo "$KERNELS" | tr ',' ' '); do \
        case "$k" in r|deno|bash) ;; *) echo "unknown kernel '$k' (known: r, deno, bash)" >&2; exit 1;; esac; \
    done

# One layer per kernel, so `docker history` shows what each adds.
RUN case ",$KERNELS," in *,r,*) \
        apt-get update \
     && apt-get install -y --no-install-recommends "r-base-core=$R_VERSION" "r-cran-irkernel=$IRKERNEL_VERSION" \
     && apt-get clean && rm -rf /var/lib/apt/lists/* \
     && R --no-echo -e 'stopifnot(capabilities("cairo")); library(IRkernel)';; \
    esac

RUN case ",$KERNELS," in *,deno,*) \
        if [ -f /opt/nbexec/ca/ca-bundle.crt ]; then export PIP_CERT=/opt/nbexec/ca/ca-bundle.crt; fi \
     && pip install --no-compile "deno==$DENO_VERSION" \
     && deno --version;; \
    esac

RUN case ",$KERNELS," in *,bash,*) \
        if [ -f /opt/nbexec/ca/ca-bundle.crt ]; then export PIP_CERT=/opt/nbexec/ca/ca-bundle.crt; fi \
     && pip install --no-compile "bash_kernel==$BASH_KERNEL_VERSION" \
     && python -m compileall -q "$(python -c 'import bash_kernel, os; print(os.path.dirname(bash_kernel.__file__))')" \
     && python -c "import bash_kernel.kernel";; \
    esac

# The launchers last, so that changing one does not reinstall the kernels; only the listed kernels' are installed.
COPY kernel_relay.py bash_kernel_launcher.py /opt/nbexec/
COPY nbexec-kernel-r nbexec-kernel-deno nbexec-kernel-bash /opt/nbexec/launchers/
RUN for k in $(echo "$KERNELS" | tr ',' ' '); do install -m 0755 "/opt/nbexec/launchers/nbexec-kernel-$k" /usr/local/bin/; done \
 && python -m compileall -q /opt/nbexec/kernel_relay.py /opt/nbexec/bash_kernel_launcher.py \
 && python -c "import ipykernel, matplotlib_inline, nbexec_display" \
 && (find / -xdev -perm /6000 -type f -exec chmod a-s {} + 2>/dev/null || true) \
 && find /opt/nbexec \( -type d ! -perm -o+rx -o -type f ! -perm -o+r -o -type f -perm /u+x ! -perm -o+x \) \
        -exec chmod a+rX {} +

LABEL io.nbexec.kernels="python${KERNELS:+,$KERNELS}"
USER 1000:1000
ENV HOME=/home/sandbox
WORKDIR /mnt/data
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["nbexec-kernel", "/run/nbexec/kernel.json"]
