"""Triton's shared-memory extensions: clients on this host hand tensors over in memory they share with the server.

A client registers a region once (system: a file in ``/dev/shm`` it made with ``shm_open``; CUDA: a
``cudaIpcMemHandle`` of device memory it allocated), then names it in its requests: an input's bytes are read
from the region, an output's written into it, and the request itself carries only names and offsets.

* ``records``: which regions are registered, one small file each in a folder every process of the server
  shares (several workers: a register call lands on one, the requests on any).
* ``regions``: one registered region opened in this process (an open file or an opened IPC handle), with its
  bounds.
* ``table``: this process's regions: register, unregister, status, limits, and the leases that keep a region
  open while a request uses it.
* ``callers``: who may register, unregister and list regions (a client on this host, unless the operator
  opts in).
* ``tensors``: one request's inputs read from and outputs written to regions, every bound checked.
"""
