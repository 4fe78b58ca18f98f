# Compilers for judging programs (nbexec.judgelangs): C and C++ (gcc, g++), Java (default-jdk-headless), Go
# (golang-go) and Rust (rustc), from Debian's packages on an nbexec runtime image, so no container registry is
# needed. The Python kernel stays the image's command: the compilers are run by the sandbox like any command.
#
#   nbexec image build --kernels judge      # passes the table's languages and a check made from it (below)
#   docker build -f judge.Dockerfile --build-arg BASE_IMAGE=nbexec-jupyter:latest -t nbexec-judge:latest .
ARG BASE_IMAGE=nbexec-jupyter:latest
FROM ${BASE_IMAGE}
USER 0:0

# One layer, so what is removed never reaches the image: Go's compiled sources of its own commands (pkg/*/cmd, 145
# MB), the tools `go build` never runs (44 MB), Go's own test suite, its API lists and the tests and test data in its
# standard library's sources (38 MB), the JDK's jmods (78 MB: only jlink reads them) and the documentation. The man
# folder must exist for the JDK's alternatives. The set-id bits that packages bring are stripped again, as in the
# runtime image.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev default-jdk-headless golang-go rustc \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && go_root="$(go env GOROOT)" && go_src="$(readlink -f "$go_root/src")" \
 && rm -rf "$go_root"/pkg/linux_*/cmd \
 && for tool in addr2line api cover dist doc fix nm objdump pprof test2json trace; do \
        rm -f "$go_root"/pkg/tool/linux_*/"$tool"; done \
 && rm -rf "$(readlink -f "$go_root/test")" "$(readlink -f "$go_root/api")" \
 && find "$go_src" -type d -name testdata -prune -exec rm -rf {} + \
 && find "$go_src" -type f -name '*_test.go' -delete \
 && rm -rf /usr/lib/jvm/*/jmods /usr/share/doc/* /usr/share/man/* /root/.cache \
 && (find / -xdev -perm /6000 -type f -exec chmod a-s {} + 2>/dev/null || true)

# The check runs as the sandbox's user in a folder of /tmp: each language of the table prints its version, compiles
# a program with the table's argv and environment, and runs it. Without a check given, the versions only.
ARG JUDGE_LANGUAGES=c,cpp,java,go,rust
ARG JUDGE_CHECK="gcc --version && g++ --version && javac -version && go version && rustc --version"
USER 1000:1000
ENV HOME=/home/sandbox
RUN dir="$(mktemp -d)" && cd "$dir" && sh -ec "$JUDGE_CHECK" && cd / && rm -rf "$dir" /tmp/nbexec-go

LABEL io.nbexec.judge="${JUDGE_LANGUAGES}"
WORKDIR /mnt/data
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["nbexec-kernel", "/run/nbexec/kernel.json"]
