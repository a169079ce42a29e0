# Redis and Webdis for fleet mode (docker-compose.fleet.yml), for machines
# that cannot pull images: Debian's redis-server and webdis binaries and the
# glibc libraries `ldd` lists, FROM scratch. Built by
# scripts/engine-images.sh, whose staged context holds rootfs/.
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/bin
WORKDIR /data
