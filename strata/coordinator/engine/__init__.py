"""The engine core: the engine thread and the scheduler that admits requests to slots, launches
windows and commits their results (engine.py, scheduler.py, scheduler_state.py; ahead.py, the
windows it sends behind one in flight), a restarted stage's rebuild, the solo path
(generate.py), and the metrics the engine observes.
May import: coordinator.speculation, coordinator.stages, coordinator, protocol"""
