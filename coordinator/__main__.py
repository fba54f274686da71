from coordinator.server import main

main()
