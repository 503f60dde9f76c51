# ascendbind — developer entry points. Everything runs from a local .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test soak test-numa test-isolation-guest test-arm64 test-arm64-suite test-systemd test-stress run lint bench clean install-service install-completion

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# ARM64_GUEST=1: the arm64 guest too (make test-arm64), several minutes of emulation more (.ci/run sets it).
# One pytest process; what is mostly computation or emulation runs beside it from the end of
# collection: the NUMA guests, and the Debian roots' host-independent files at nice 19
# (tests/conftest.py); their tests wait for them at the end of the session.
test: install
	$(BIN)/python -m pytest -q

# the soak-marked tests (tests/soak.py) at their large counts: thousands of pid recycles,
# ten thousand fuzzed requests, binds timed while another uid hogs the socket (a few minutes)
soak: install
	$(BIN)/python -m pytest -q -m soak --soak

# the tests of tests/numa/ on real multi-NUMA kernels: a 2-node and a 4-node QEMU guest of this
# machine's kernel, and the isolation guest (make test runs them too, through tests/test_numa_guest.py)
test-numa: install
	$(BIN)/python -m tests.numa_guest

# isolation under stress-ng --cpu 8 in a 2-node guest of its own (IRQ counts, the neighbour's
# threads, every restore): make test runs it too, beside the other guests; this runs it alone
test-isolation-guest: install
	$(BIN)/python -m tests.numa_guest --topology isolation --timeout 3000

# the target architecture: Debian's arm64 kernel under qemu-system-aarch64 with a Kunpeng 920's
# four NUMA nodes and an arm64 userland (tests/arm64_guest.py; `make test ARM64_GUEST=1` runs it
# too, through tests/test_numa_guest.py). Its image is built once, without emulation, and cached in
# ~/.cache/ascendbind-arm64 (ARM64_CACHE), rebuilt when tests/arm64_image.py changes.
test-arm64: install
	$(BIN)/python -m tests.arm64_guest

# The plain suite's architecture-sensitive files on the arm64 guest, in one boot (about 50 minutes
# under load: tests run some 70 times slower there); docs/operations.md lists what runs and what cannot.
ARM64_SUITE ?= $(addprefix tests/,test_applier_affinity.py test_applier_irq.py test_applier_memory.py \
	test_applier_pagewalk.py test_mempolicy.py test_discovery_tasks.py test_process_identity.py \
	test_discovery_parsers.py test_discovery_columns.py test_discovery_numa_maps.py test_discovery_memmap.py \
	test_discovery_kernel.py test_cpulist.py test_golden_plans.py test_planner_alignment.py \
	test_planner_errors.py test_planner_explain.py test_planner_merge.py test_planner_policy.py \
	test_planner_roles.py test_planner_seed.py test_planner_smt.py test_daemon_wire.py test_client_wire.py \
	test_irqbalance_protocol.py test_lifecycle_rules.py test_targets_rule.py test_state_record.py \
	test_settings.py test_config.py)
test-arm64-suite: install
	$(BIN)/python -m tests.arm64_guest --timeout 4200 -- --pytest 1 $(ARM64_SUITE)

# The units under this machine's systemd as PID 1 (booted with systemd-nspawn; root). `make test`
# runs them too. The checkout is installed for them into .venv/opt-ascendbind (the /opt/ascendbind
# the unit runs), rebuilt when the source changes.
test-systemd: install
	$(BIN)/python -m pytest -q tests/test_systemd_service.py

# Each test file FILES names (default: all) must pass RUNS consecutive runs while
# BURNERS busy-looping processes keep the CPUs busy:  make test-stress FILES=tests/test_daemon_api.py
FILES   ?= $(wildcard tests/test_*.py)
RUNS    ?= 30
BURNERS ?= 2
test-stress: install
	$(BIN)/python tests/stress.py --runs $(RUNS) --burners $(BURNERS) $(FILES)

run: install
	$(BIN)/python -m ascendbind.demo

lint: install
	$(BIN)/python -m compileall -q ascendbind tests bench
	$(BIN)/python -m pip install -q pyflakes
	$(BIN)/python -m pyflakes ascendbind tests bench

# Runs every bench (a few minutes), then writes docs/benchmarks.md and docs/bench/*.png.
# matplotlib is a bench-only extra: installed here (and by .ci/run, for the suite's plot test), never needed by the daemon.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	@command -v stress-ng >/dev/null 2>&1 || echo "make bench: stress-ng not found (apt-get install stress-ng); the noisy neighbour will be our own spinning processes"
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info build dist

# ---------------------------------------------------------------- host install
# After `pip install .` (as root pip puts the command in /usr/local/bin, a venv in
# its bin/), install the systemd units with ExecStart= pointing at that command,
# and the docs their Documentation= names:
#     make install-service                     (then: systemctl enable --now ascendbind.socket)
#     make install-service ASCENDBIND=/opt/ascendbind/bin/ascendbind DESTDIR=/tmp/stage
# The unit's ProtectHome=yes hides /home, /root and /run/user from the daemon, so a
# command installed there could not start: that is refused here, not at boot.
ASCENDBIND    ?= $(shell command -v ascendbind 2>/dev/null)
DESTDIR       ?=
UNITDIR       ?= /etc/systemd/system
DOCDIR        ?= /usr/share/doc/ascendbind
COMPLETIONDIR ?= /usr/share/bash-completion/completions

install-service:
	@case "$(ASCENDBIND)" in \
	  "") echo "install-service: no ascendbind in PATH; pip install . first, or pass ASCENDBIND=/abs/path" >&2; exit 2 ;; \
	  /home/*|/root/*|/run/user/*) echo "install-service: $(ASCENDBIND) is under a directory the unit's ProtectHome=yes hides; install ascendbind elsewhere" >&2; exit 2 ;; \
	  /*) ;; \
	  *) echo "install-service: ASCENDBIND=$(ASCENDBIND) is not an absolute path" >&2; exit 2 ;; \
	esac; \
	case "$(ASCENDBIND)$(DOCDIR)" in *[!A-Za-z0-9/._+-]*) \
	  echo "install-service: ASCENDBIND and DOCDIR may hold only letters, digits and / . _ + -" >&2; exit 2 ;; esac; \
	test -x "$(ASCENDBIND)" || { echo "install-service: $(ASCENDBIND) is not an executable file" >&2; exit 2; }
	install -d -m 0755 "$(DESTDIR)$(UNITDIR)" "$(DESTDIR)$(DOCDIR)"
	sed -e 's|^ExecStart=/usr/bin/ascendbind |ExecStart=$(ASCENDBIND) |' \
	    -e 's|file:/usr/share/doc/ascendbind/|file:$(DOCDIR)/|' \
	    systemd/ascendbind.service > "$(DESTDIR)$(UNITDIR)/ascendbind.service"
	sed -e 's|file:/usr/share/doc/ascendbind/|file:$(DOCDIR)/|' \
	    systemd/ascendbind.socket > "$(DESTDIR)$(UNITDIR)/ascendbind.socket"
	chmod 0644 "$(DESTDIR)$(UNITDIR)/ascendbind.service" "$(DESTDIR)$(UNITDIR)/ascendbind.socket"
	install -m 0644 README.md LICENSE config.example.toml docs/*.md "$(DESTDIR)$(DOCDIR)/"
	@if [ -z "$(DESTDIR)" ] && command -v systemctl >/dev/null 2>&1; then systemctl daemon-reload; fi
	@echo "installed the units for $(ASCENDBIND); next: systemctl enable --now ascendbind.socket ascendbind.service"

# bash completion generated by the installed command itself, so it matches its version
install-completion:
	@test -n "$(ASCENDBIND)" || { echo "install-completion: no ascendbind in PATH; pass ASCENDBIND=" >&2; exit 2; }
	install -d -m 0755 "$(DESTDIR)$(COMPLETIONDIR)"
	"$(ASCENDBIND)" completion bash > "$(DESTDIR)$(COMPLETIONDIR)/ascendbind.tmp"
	mv "$(DESTDIR)$(COMPLETIONDIR)/ascendbind.tmp" "$(DESTDIR)$(COMPLETIONDIR)/ascendbind"
	chmod 0644 "$(DESTDIR)$(COMPLETIONDIR)/ascendbind"
