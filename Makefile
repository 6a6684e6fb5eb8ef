# kvmesh: `make up` runs it, `make test` checks it, `make bench` measures it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export MC_TCP_BIND_ADDRESS ?= 127.0.0.1

.PHONY: install sysdeps imagedeps agentclis kernels model up test lint bench protos deploy images clean

# Mooncake's engine links libibverbs/librdmacm even for TCP: install them when missing (root).
sysdeps:
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1; then \
	  echo "installing libibverbs1 librdmacm1 libnuma1"; \
	  apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 libnuma1 >/dev/null; }; \
	fi

# podman + runc (crun cannot run on these hosts' hybrid cgroups) and debootstrap (the images' base
# OS without a registry): for `make images` and the image test; missing tools make it skip.
imagedeps:
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then \
	  echo "installing podman runc debootstrap"; \
	  apt-get install -y -q podman runc fuse-overlayfs uidmap debootstrap >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q podman runc fuse-overlayfs uidmap debootstrap >/dev/null; } || \
	  echo "could not install them: the image tests will skip"; \
	fi

# The agents' own CLIs, pinned, for tests/integration/test_agent_clis.py (skipped without npm).
AGENT_CLIS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33
AGENT_DIR  := $(VENV)/agent-clis
agentclis: install
	@if [ -f $(AGENT_DIR)/.stamp ] && [ "$$(cat $(AGENT_DIR)/.stamp)" = "$(AGENT_CLIS)" ]; then :; \
	elif command -v npm >/dev/null; then \
	  echo "installing $(AGENT_CLIS)"; mkdir -p $(AGENT_DIR) && \
	  npm install -q --prefix $(AGENT_DIR) --no-audit --no-fund --no-save $(AGENT_CLIS) >$(AGENT_DIR)/npm.log 2>&1 && \
	  echo "$(AGENT_CLIS)" > $(AGENT_DIR)/.stamp || echo "npm install failed ($(AGENT_DIR)/npm.log): the agent CLI test will skip"; \
	else echo "npm not found: the agent CLI test will skip"; fi

$(STAMP): pyproject.toml | sysdeps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The C++ CPU kernels, compiled here by the machine's compiler (a no-op once built; skipped with
# a message on CPUs without AVX-512, where the torch paths run).
kernels: install
	$(BIN)/python -m kvmesh.engine.kernels.build

# Fetch (once) and verify the default model into $$KVMESH_HOME (default ~/.cache/kvmesh).
model: kernels
	$(BIN)/python -c "from kvmesh.engine.loader import DEFAULT_MODEL, resolve_model; print('model:', resolve_model(DEFAULT_MODEL).gguf_file)"

up: model
	$(BIN)/kvmesh up

# The layers' import contract (tests/unit/test_layers.py) is part of lint.
lint: install
	$(BIN)/ruff check kvmesh services tests scripts
	$(BIN)/ruff format --check kvmesh services tests scripts
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_layers.py

# pytest exits 5 when it collects nothing: that is a failure here, as is any other non-zero code.
test: model lint imagedeps agentclis
	$(BIN)/python -m pytest -q -p no:cacheprovider; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

bench: model
	$(BIN)/kvmesh bench offline --concurrency 1,8,32 --dtype fp32,bf16 --output bench/results/offline.json
	$(BIN)/kvmesh bench transfer --output bench/results/transfer.json
	$(BIN)/kvmesh bench kv --output bench/results/kv.json
	$(BIN)/kvmesh bench spec --output bench/results/spec.json
	$(BIN)/kvmesh bench weights --output bench/results/weights.json
	$(BIN)/kvmesh bench coldstart --output bench/results/coldstart.json
	$(BIN)/kvmesh bench agent-api --output bench/results/agent-api.json
	$(BIN)/kvmesh bench parallel --output bench/results/parallel.json

protos: install
	$(BIN)/python scripts/gen_protos.py

# The rendered parts of deploy/ (Containerfiles, Kubernetes base) from kvmesh_apps/deploy/services.py.
deploy: install
	$(BIN)/python scripts/gen_deploy.py

# One image per service (deploy/images), built here with podman: see kvmesh_apps/deploy/build.py.
images: install imagedeps
	$(BIN)/python -m kvmesh_apps.deploy.build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
