"""Suite-wide: tests marked `destructive` (they kill processes of the shared cluster)
run after every other test."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("destructive") is not None)
