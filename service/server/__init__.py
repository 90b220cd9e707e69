"""Processes and sockets: ``main.serve`` runs one server (``run``) or a supervisor of workers and an engine
process (``supervisor``); ``process`` configures each process, ``transport`` and ``balance`` shape its HTTP
connections. The app (``service.api``) knows only requests."""
