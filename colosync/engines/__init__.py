"""The engines colosync updates; which name serves which class is ``colosync.control.registry``."""
