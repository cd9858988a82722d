"""The engine under both front-ends (``fully_shard`` and ``replicate``): segment layouts and the
machinery they share."""
