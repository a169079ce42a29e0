# Our tools, FROM scratch: nothing to pull. Staged by `make images`
# (scripts/images.sh) under target/docker/tools: bin/ (the host tools as
# `make build` makes them, and the static healthcheck probe), libs/ (the
# glibc libraries the tools link, at their paths), stakegate/ (configs,
# scenarios, policies), fonts/ (for the plots) and an empty tmp/.

# The mock node. Its arguments come from the stack volume (--args-file).
FROM scratch AS rpc-node
COPY libs/ /
COPY bin/rpc-node /bin/rpc-node
ENTRYPOINT ["/bin/rpc-node"]

# `stakegate` (scenario stack / run, probe) with the load generator it
# drives; modules are mounted at /modules.
FROM scratch AS loadgen
COPY libs/ /
COPY bin/stakegate bin/loadgen bin/stakegate-probe /bin/
COPY stakegate/ /stakegate/
COPY fonts/ /usr/share/fonts/truetype/dejavu/
COPY tmp/ /tmp/
ENV PATH=/bin \
    STAKEGATE_ROOT=/stakegate \
    STAKEGATE_TOOLS=/bin \
    STAKEGATE_MODULES=/modules
WORKDIR /work
ENTRYPOINT ["/bin/stakegate"]
