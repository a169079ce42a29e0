# Our tools as static (musl) binaries, FROM scratch: nothing to pull.
# Built by `make images` (scripts/images.sh), whose staged context under
# target/docker/tools holds bin/, stakegate/ (configs, scenarios, policies),
# fonts/ (for the plots) and an empty tmp/.

# The mock node. Its arguments come from the stack volume (--args-file).
FROM scratch AS rpc-node
COPY bin/rpc-node /bin/rpc-node
ENTRYPOINT ["/bin/rpc-node"]

# `stakegate` (scenario stack / run, probe) with the load generator it
# drives; modules are mounted at /modules.
FROM scratch AS loadgen
COPY bin/stakegate bin/loadgen /bin/
COPY stakegate/ /stakegate/
COPY fonts/ /usr/share/fonts/truetype/dejavu/
COPY tmp/ /tmp/
ENV PATH=/bin \
    STAKEGATE_ROOT=/stakegate \
    STAKEGATE_TOOLS=/bin \
    STAKEGATE_MODULES=/modules
WORKDIR /work
ENTRYPOINT ["/bin/stakegate"]
