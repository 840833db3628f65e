"""The built-in job kinds' handlers; their declarations are in ``herald.kinds``."""
