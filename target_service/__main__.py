from target_service.server import main

main()
