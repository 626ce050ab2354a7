# The edl image: the one `edl` binary, every role (operator, master, pserver, trainer;
# `edl run` too). Multi-stage: built in the Rust image, shipped on distroless's glibc
# base (no shell, no package manager) as a non-root user.
#
#   docker build -t edl:0.1.0 .
#
# Jobs whose trainers are `entry` programs (Python, ...) build their own image FROM
# this one, adding the program and its runtime; deploy/ and docs/kubernetes.md say how
# the image is used.

# etcd's own restore tool, for `edl operator restore-etcd-member` (the pods that restore a
# managed etcd from a snapshot): the etcd image the operator runs members with.
FROM quay.io/coreos/etcd:v3.5.17 AS etcd

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
# Only the binary's crates; no protoc is needed (the protocol's code is generated in
# Rust). Debug info is dropped from the shipped binary.
RUN cargo build --release --locked -p edl \
 && objcopy --strip-debug target/release/edl /edl

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /edl /usr/local/bin/edl
COPY --from=etcd /usr/local/bin/etcdutl /usr/local/bin/etcdutl
# distroless' "nonroot" user; the pods' securityContext asks for the same.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/edl"]
