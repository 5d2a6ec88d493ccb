"""Launch: the `pdserve` command line, the Serve application builder and its config, how Ray
is reached, and a bounded shutdown."""
