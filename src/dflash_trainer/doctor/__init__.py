"""`dflash doctor`: pre-flight checks of a config against its target and data, each with a fix."""
