from tierd.cli import main

main()
