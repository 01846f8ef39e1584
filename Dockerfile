# syntax=docker/dockerfile:1
# Build: a pinned Rust toolchain image; run: distroless, non-root, no shell.
FROM rust:1.95.0-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin ddb-aggregator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/ddb-aggregator /usr/local/bin/ddb-aggregator
COPY config /etc/ddb-aggregator/examples
# 65532 is distroless's nonroot user; numeric, so Kubernetes can check runAsNonRoot.
USER 65532:65532
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/ddb-aggregator"]
CMD ["run", "--config", "/etc/ddb-aggregator/config.yaml"]
