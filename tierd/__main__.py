from tierd.tools.cli import main

main()
