"""gloo's transport: the TCP mesh between a group's ranks and the same-host shared memory
(docs/architecture.md, "The mesh", for the order of its parts)."""
