"""Deterministic fault-injection simulations of the trionserve runtime on a virtual clock.

Each scenario builds the real actor tree (registry, watcher, model versions with
their schedulers and executors, the DataPlane) around a temporary model
repository of simulated models, drives it with simulated clients and a seeded
fault plan on ``trio.testing.MockClock``, then checks the invariants in
:mod:`simulations.invariants`. ``python -m simulations list`` lists the
scenarios; ``python -m simulations run SCENARIO --seed N`` replays one run.
"""
