// A transfer servlet on Debian's Jetty 9.4, mapped at /v1/transfers as a servlet
// application maps it, that counts its executions.
import java.io.IOException;
import java.util.concurrent.atomic.AtomicInteger;
import javax.servlet.http.HttpServlet;
import javax.servlet.http.HttpServletRequest;
import javax.servlet.http.HttpServletResponse;
import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;
import org.eclipse.jetty.servlet.ServletContextHandler;
import org.eclipse.jetty.servlet.ServletHolder;

public class Transfers {
    static final AtomicInteger EXECUTIONS = new AtomicInteger();

    static void json(HttpServletResponse res, int status, int n) throws IOException {
        res.setStatus(status);
        res.setContentType("application/json");
        res.getWriter().write("{\"n\":" + n + "}");
    }

    public static class Transfer extends HttpServlet {
        @Override
        protected void doPost(HttpServletRequest req, HttpServletResponse res) throws IOException {
            json(res, 201, EXECUTIONS.incrementAndGet());
        }
    }

    public static class Count extends HttpServlet {
        @Override
        protected void doGet(HttpServletRequest req, HttpServletResponse res) throws IOException {
            json(res, 200, EXECUTIONS.get());
        }
    }

    public static void main(String[] args) throws Exception {
        Server server = new Server();
        ServerConnector http = new ServerConnector(server);
        http.setHost("127.0.0.1");
        http.setPort(Integer.parseInt(args[0]));
        server.addConnector(http);
        ServletContextHandler context = new ServletContextHandler();
        context.setContextPath("/");
        context.addServlet(new ServletHolder(new Transfer()), "/v1/transfers");
        context.addServlet(new ServletHolder(new Count()), "/count");
        server.setHandler(context);
        server.start();
        server.join();
    }
}
