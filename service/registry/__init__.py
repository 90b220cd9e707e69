"""Model versions: the table a request is routed through, the manager that changes it, the store on disk.

``manager`` (start, upload, delete, load) changes what ``table`` holds; ``version`` is one served version;
``sync`` follows a store other processes change; ``metadata`` is what the store keeps about a version;
``store`` is the durable, atomic repository; ``acceptance`` and ``sandbox`` decide what an upload may become;
``repository`` is Triton's model-repository extension (index, durable unload, load) and ``statistics`` its
statistics extension (per-version counters).
"""
