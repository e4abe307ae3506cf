"""`python -m strand.launch_server [--model-path P] [--port 30000] ...`: start a Strand server.

Also installed as the `strand-server` console script. `--help` lists every argument.
"""

from strand.runtime.http_server import main

if __name__ == "__main__":
    main()
