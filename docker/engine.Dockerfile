# Debian binaries for the compose stacks, for machines that cannot pull
# images: Redis and Webdis (fleet mode, docker-compose.fleet.yml) or
# Prometheus (docker-compose.yml), with the glibc libraries `ldd` lists,
# FROM scratch. Built by scripts/engine-images.sh, whose staged context
# holds rootfs/.
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/bin
WORKDIR /data
