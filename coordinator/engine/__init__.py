"""The decision core: pure code that takes events and returns instructions.

``engine`` decides, ``events`` names what it hears and what it asks, ``model`` and ``states``
hold the trials and environments it decides on, ``scheduler`` and ``waiting`` place trials,
``policy`` is what it knows of the config, ``rows`` what it hands the store, ``restore``
rebuilds it after a crash. Nothing here imports asyncio, gRPC, protobuf, SQLite, the store,
the read side or a platform: ``tests/unit/test_imports.py`` checks it.
"""
